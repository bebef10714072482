"""Backend choice: auto runs the native target where it is exact, transformers elsewhere; explicit choices
are honoured or refused with the reason; a config that does not describe the weights is refused at load."""
import json
import os
import shutil

import pytest
from tiny import save_tiny

from peagle.errors import PeagleError
from peagle.models.hf_target import HFTarget
from peagle.models.llama import Transformer
from peagle.models.loader import load_target, resolve_backend


def test_auto_native_for_llama_family_transformers_for_the_rest(tiny_dirs, family_dirs):
    for d in tiny_dirs.values():
        assert resolve_backend(d) == "native"
    for d in family_dirs.values():
        assert resolve_backend(d) == "transformers"
    assert isinstance(load_target(tiny_dirs["qwen3"]), Transformer)
    assert isinstance(load_target(tiny_dirs["qwen3"], backend="transformers"), HFTarget)
    assert isinstance(load_target(family_dirs["gpt_oss"]), HFTarget)


def test_native_refusals_name_the_reason(tmp_path, family_dirs):
    with pytest.raises(PeagleError, match="model_type='gpt_oss'.*--target-backend transformers"):
        load_target(family_dirs["gpt_oss"], backend="native")
    # Qwen2 with a window on layers >= max_window_layers only: native refuses, auto takes transformers
    mixed = save_tiny("qwen2", str(tmp_path / "q2sw"), use_sliding_window=True, sliding_window=8, max_window_layers=2)
    with pytest.raises(PeagleError, match="some layers only"):
        load_target(mixed, backend="native")
    assert resolve_backend(mixed) == "transformers"
    with pytest.raises(PeagleError, match="must be one of"):
        resolve_backend(mixed, "vllm")
    with pytest.raises(PeagleError, match="not found"):
        resolve_backend(str(tmp_path / "nope"))


@pytest.mark.parametrize("patch, match", [
    ({"num_hidden_layers": 2}, "hold 4 layers"), ({"num_attention_heads": 8}, "q_proj.weight has shape"),
    ({"num_key_value_heads": 4}, "k_proj.weight has shape"), ({"intermediate_size": 64}, "gate_proj.weight has shape"),
    ({"num_hidden_layers": 3}, "hold 4 layers"),              # one layer more than the config: the boundary
    ({"vocab_size": 600}, "embed_tokens shape"),              # logits over 512 ids for a 600-token vocabulary
])
@pytest.mark.parametrize("quantization", ["none", "q4"])
def test_a_config_that_does_not_describe_the_weights_is_one_line(tiny_dirs, tmp_path, patch, match, quantization):
    """Fewer layers in the config than in the weights ran the first ones and gave wrong outputs; wrong head
    counts failed inside the first forward's kernel: both are refused at load, naming the tensor."""
    d = str(tmp_path / "m")
    shutil.copytree(tiny_dirs["llama"], d)
    assert load_target(d, quantization=quantization) is not None               # the control loads
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, **patch}, f)
    with pytest.raises(PeagleError, match=match):
        load_target(d, quantization=quantization)


@pytest.mark.parametrize("family, over, native", [
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, False),   # SiLU was assumed: wrong logits, chosen by auto
    ("qwen3", {"hidden_act": "gelu"}, False),
    ("qwen3", {"attention_bias": True}, True),               # o_proj's bias was dropped: now loaded
    ("llama", {"mlp_bias": True}, False),                    # failed at load: now transformers runs it
    ("mistral", {"attention_bias": True}, True),             # mistral has no biases: the key means nothing
])
def test_auto_runs_natively_only_what_the_native_target_computes(tmp_path, family, over, native):
    """Config keys the native target ignored gave wrong output under `auto`, and keys it could not load failed
    where transformers runs the model. Each case now runs natively with transformers' greedy output, or goes
    to the transformers backend, whose output is transformers' own."""
    from tiny import hf_greedy

    from peagle import LLM, SamplingParams
    d = save_tiny(family, str(tmp_path / "m"), **over)
    assert (resolve_backend(d) == "native") == native
    prompts = [[5, 17, 200, 33], [9, 8, 7, 6, 5, 4, 3, 250, 100]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM(d).generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == hf_greedy(d, prompts, 8)


def test_quantized_or_bin_checkpoints_and_phantom_tokenizers(tiny_dirs, tmp_path):
    """An FP8 checkpoint ran natively with its weight scales ignored, a .bin-only one failed natively where
    transformers reads it: both go to transformers. A directory without tokenizer files got an empty
    tokenizer of its family's class from transformers, whose eos id (0) stopped generation: None now."""
    import torch
    from safetensors.torch import load_file

    from peagle.llm import load_tokenizer
    d = str(tmp_path / "q")
    shutil.copytree(tiny_dirs["llama"], d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": {"quant_method": "compressed-tensors"}}, f)
    assert resolve_backend(d) == "transformers"
    with pytest.raises(PeagleError, match="quantized checkpoint"):
        load_target(d, backend="native")
    b = str(tmp_path / "bin")
    shutil.copytree(tiny_dirs["llama"], b)
    torch.save(load_file(os.path.join(b, "model.safetensors")), os.path.join(b, "pytorch_model.bin"))
    os.remove(os.path.join(b, "model.safetensors"))
    assert resolve_backend(b) == "transformers" and isinstance(load_target(b), HFTarget)
    bare = save_tiny("qwen2", str(tmp_path / "bare"))
    assert load_tokenizer(bare) is None


def test_a_head_or_a_file_as_the_model_says_so(tmp_path, tiny_dirs):
    """A drafter head given as the target failed at load with "weights are missing tensor
    'model.embed_tokens.weight'", a model's config.json as "model directory ... not found": one line each now
    naming the mistake; the directory itself still resolves (negative control)."""
    from peagle.llm import DEMO_PEAGLE_HEAD
    d = tiny_dirs["qwen3"]
    assert resolve_backend(d) == "native"
    with pytest.raises(PeagleError, match="is a file, not a model directory"):
        resolve_backend(os.path.join(d, "config.json"))
    with pytest.raises(PeagleError, match="is a drafter head, not a target model"):
        load_target(DEMO_PEAGLE_HEAD)
    for backend in ("native", "transformers"):                       # an explicit backend is told the same
        with pytest.raises(PeagleError, match="is a drafter head"):
            resolve_backend(DEMO_PEAGLE_HEAD, backend)
