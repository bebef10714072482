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
