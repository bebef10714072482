"""GGUF files run as stored (peagle/models/gguf_target.py): Q4_0 / Q4_1 / Q8_0 blocks load without dequantizing
and agree with transformers' dequantized reading (weights and logits), the packaged table names the default
target's file, and the default target's q4 runs that file's blocks."""
import os

import numpy as np
import pytest
import torch

from peagle.models import quant as Q
from peagle.models import quant_ext


def test_gguf_blocks_load_as_stored_and_match_transformers(tiny_gguf, qtarget):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from peagle.models.gguf_target import read_gguf
    from peagle.models.llama import Transformer
    d, name = os.path.split(tiny_gguf)
    cfg = AutoConfig.from_pretrained(d, gguf_file=name)
    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(cfg)
    hf = load_gguf_checkpoint(tiny_gguf, return_tensors=True, model_to_load=skel)["tensors"]
    _, floats, quants = read_gguf(tiny_gguf)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"} <= set(quants)
    assert {q.qtype for q in quants.values()} == {Q.Q4_0, Q.Q4_1, Q.Q8_0}
    for k, q in quants.items():                 # the blocks, unpermuted, dequantize to transformers' reading
        ref = torch.as_tensor(np.asarray(hf[k])).float()
        assert torch.allclose(q.dense(), ref, rtol=0, atol=1e-6 * float(ref.abs().max())), k
    for k, f in floats.items():
        assert torch.equal(f, torch.as_tensor(np.asarray(hf[k])).float()), k
    t = Transformer.from_gguf(tiny_gguf, quantization="q4")
    assert "tiny.gguf" in t.precision and "Q4_0" in t.precision
    assert isinstance(t.layers[0].qkv_w, Q.QuantWeight) and t.layers[0].qkv_w.qtype == Q.Q4_1  # Q4_0 q/k + Q4_1 v
    # logits: the GGUF's blocks as stored vs transformers' dequantized model on the same ids
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    missing = model.load_state_dict({k: torch.as_tensor(np.asarray(v)).float() for k, v in hf.items()}, strict=False)
    assert not [k for k in missing.missing_keys if "rotary" not in k]
    ids = torch.randint(5, 500, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    got, _ = t.forward(ids, t.new_cache(1, 16), 0, torch.zeros(1, dtype=torch.long))
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4)
    f32 = Transformer.from_gguf(tiny_gguf, quantization="none")       # read as float32: no block kept as stored
    assert all(getattr(w, "qtype", Q.F32) == Q.F32 for w in f32._projections())


def test_packaged_gguf_table_agrees_with_the_default_target():
    from peagle import default_target
    from peagle.models.gguf_target import PACKAGED
    assert PACKAGED[default_target.GGUF_SHA256] == (default_target.PACKAGE.replace("-", "_"), default_target.GGUF_NAME)


def test_default_target_q4_runs_the_packaged_gguf_blocks():
    """SmolLM2's float32 target is the dequantized Q4_1 file; q4 loads that file's blocks, which dequantize to
    the float32 checkpoint's weights."""
    from peagle.llm import DEFAULT_MODEL
    from peagle.models.gguf_target import source_gguf
    from peagle.models.llama import Transformer, load_safetensors
    if not os.path.isfile(os.path.join(DEFAULT_MODEL, "model.safetensors")) or source_gguf(DEFAULT_MODEL) is None:
        pytest.skip("the default target is not set up (make setup)")
    t = Transformer.from_pretrained(DEFAULT_MODEL, quantization="q4", layout="io")
    assert "Q4_1" in t.precision and ".gguf" in t.precision
    sd = load_safetensors(DEFAULT_MODEL, torch.float32)
    for i in (0, len(t.layers) - 1):
        p = f"model.layers.{i}."
        ref = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        assert torch.allclose(t.layers[i].gate_up.dense(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
        ref = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.allclose(t.layers[i].qkv_w.dense(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    assert torch.equal(t.embed, sd["model.embed_tokens.weight"])


def test_llm_runs_a_gguf_file(tiny_gguf):
    from peagle import LLM, SamplingParams
    llm = LLM(tiny_gguf, quantization="q4")
    assert "tiny.gguf" in llm.engine.target.precision
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_auto_follows_the_projections_block_types_not_the_embeddings(qtarget, tmp_path):
    """A file of float projections with a Q4_0 embedding runs as float (auto re-quantized every projection to
    Q4_1 and called them "blocks as stored"); Q4 projections make it q4."""
    import gguf
    from ggufs import write_tiny_gguf

    from peagle.models.gguf_target import block_family
    T = gguf.GGMLQuantizationType
    f, q = str(tmp_path / "f.gguf"), str(tmp_path / "q.gguf")
    write_tiny_gguf(qtarget, f, {"proj.weight": T.F16, "embed_tokens.weight": T.Q4_0})
    write_tiny_gguf(qtarget, q, {"proj.weight": T.Q4_0, "embed_tokens.weight": T.F16})
    assert block_family(f) is None and block_family(q) == "q4"


@pytest.mark.skipif(quant_ext.get() is None,
                    reason="needs the built extension (q4a8)")
def test_a_converted_directory_runs_its_source_blocks_only_while_its_weights_are_the_conversions(qtarget, tmp_path):
    """q4 / auto on a directory converted from a GGUF file run that file's blocks; once model.safetensors is
    replaced (fine-tuned in place), they ran the old file's weights: now the directory's own weights. A Q8_0-only
    source runs its blocks under q8 (auto says so), not under q4."""
    import json
    import shutil

    import gguf
    from ggufs import write_tiny_gguf
    from tiny import save_tiny

    from peagle.models.gguf import sha256_file
    from peagle.models.loader import load_target
    T = gguf.GGMLQuantizationType
    d = str(tmp_path / "conv")
    shutil.copytree(qtarget, d)
    write_tiny_gguf(d, os.path.join(d, "src.gguf"), {"proj.weight": T.Q4_1})
    stamp = os.path.join(d, "conversion.json")
    st = os.path.join(d, "model.safetensors")
    with open(stamp, "w") as f:
        json.dump({"source": "src.gguf", "safetensors_sha256": sha256_file(st)}, f)
    assert "blocks of src.gguf" in load_target(d, quantization="q4").precision
    with open(stamp) as f:
        assert json.load(f)["safetensors_stat"][0] == os.path.getsize(st)        # noted: later loads do not hash
    assert "blocks of src.gguf" in load_target(d, quantization="q4a8").precision
    assert "blocks of" not in load_target(d, quantization="q8").precision      # Q4 blocks are not q8's
    other = str(tmp_path / "other")
    save_tiny("llama", other, intermediate_size=128, seed=7)
    shutil.copy(os.path.join(other, "model.safetensors"), st)                    # replaced in place
    assert "blocks of" not in load_target(d, quantization="q4").precision
    assert load_target(d, quantization="auto").quantization == "none"


def test_a_qwen2_gguf_keeps_its_qk_rows_in_order(tiny_dirs, tmp_path):
    """llama.cpp permutes the q/k rows of the llama architecture only (transformers' GGUF loader undoes it for
    llama only): a Qwen2 file's rows are in HF order, so its logits are the checkpoint's it was written from."""
    from ggufs import write_tiny_gguf

    from peagle.models.llama import Transformer
    path = str(tmp_path / "qwen2.gguf")
    write_tiny_gguf(tiny_dirs["qwen2"], path, {}, arch="qwen2")
    ids = torch.randint(5, 500, (1, 11), generator=torch.Generator().manual_seed(0))
    z = torch.zeros(1, dtype=torch.long)
    ref = Transformer.from_pretrained(tiny_dirs["qwen2"])
    want, _ = ref.forward(ids, ref.new_cache(1, 16), 0, z)
    t = Transformer.from_gguf(path)
    assert t.cfg.model_type == "qwen2" and t.cfg.qkv_bias
    got, _ = t.forward(ids, t.new_cache(1, 16), 0, z)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
