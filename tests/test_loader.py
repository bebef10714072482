"""Backend choice: auto runs the native target where it is exact, transformers elsewhere; explicit choices
are honoured or refused with the reason."""
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
