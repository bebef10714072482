"""`peagle convert-gguf` and the default target: the converted SmolLM2 equals transformers' own reading of
the package's GGUF (logits), the conversion is pinned, and a bad GGUF gets a one-line error and writes nothing."""
from __future__ import annotations

import os

import pytest
import torch

from peagle.errors import PeagleError
from peagle.models.gguf import convert


@pytest.fixture(scope="module")
def smollm2():
    from peagle.default_target import ensure
    return ensure(verbose=False)


def test_converted_target_matches_transformers_reading_of_the_gguf(smollm2):
    """Reference: transformers' GGUF reader (load_gguf_checkpoint: dequantization by `gguf`, q/k rows
    un-permuted) into transformers' LlamaForCausalLM; ours: the converted directory in peagle's native target."""
    import transformers as tf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from peagle.default_target import gguf_path
    from peagle.models.llama import Transformer
    cfg = tf.AutoConfig.from_pretrained(smollm2)
    ref = tf.LlamaForCausalLM(cfg).eval()
    sd = load_gguf_checkpoint(gguf_path(), return_tensors=True, model_to_load=ref)["tensors"]
    missing, _ = ref.load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"}                     # tied to the embedding
    ref.tie_weights()
    ours = Transformer.from_pretrained(smollm2)
    tok = tf.AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is a tuple in Python?"}],
                                  add_generation_prompt=True, return_dict=False)
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        want = ref(x).logits[0]
    got, _ = ours.forward(x, ours.new_cache(1, x.shape[1] + 8), 0, torch.zeros(1, dtype=torch.long))
    assert (got[0] - want).abs().max() < 2e-3 * want.abs().max()
    assert torch.equal(got[0].argmax(-1), want.argmax(-1))
    # the chat template and specials came along
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


def test_default_target_conversion_is_pinned(smollm2):
    import json

    from peagle.default_target import GGUF_SHA256, SAFETENSORS_SHA256
    with open(os.path.join(smollm2, "conversion.json")) as f:
        rec = json.load(f)
    assert rec["gguf_sha256"] == GGUF_SHA256 and rec["safetensors_sha256"] == SAFETENSORS_SHA256
    assert rec["parameters"] == 134_515_008


def _writer_file(path, arch):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["truncated", "corrupt", "unsupported", "missing", "empty-llama"])
def test_a_bad_gguf_gets_a_clear_error_and_writes_nothing(tmp_path, case):
    src = str(tmp_path / "in.gguf")
    if case == "truncated":
        from peagle.default_target import gguf_path
        with open(gguf_path(), "rb") as f, open(src, "wb") as g:
            g.write(f.read(3 << 20))
    elif case == "corrupt":
        with open(src, "wb") as g:
            g.write(b"GGUF" + os.urandom(4096))
    elif case == "unsupported":
        _writer_file(src, "gpt2")
    elif case == "empty-llama":
        _writer_file(src, "llama")                       # a llama header without the model's tensors
    out = tmp_path / "out"
    with pytest.raises(PeagleError) as e:
        convert(src, str(out))
    assert "\n" not in str(e.value) and str(e.value)
    assert sorted(os.listdir(tmp_path)) == (["in.gguf"] if case != "missing" else [])   # no output, no temp dir


def test_cli_reports_one_line_and_refuses_to_overwrite(tmp_path, capsys):
    from peagle.cli import main
    assert main(["convert-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.strip().startswith("peagle: error: GGUF file not found")
    (tmp_path / "o").mkdir()
    with pytest.raises(PeagleError, match="exists"):
        convert(str(tmp_path / "nope.gguf"), str(tmp_path / "o"))
