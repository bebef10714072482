"""The speculative config: vLLM's keys, plus "auto" K, its bound, and vLLM's per-batch-size schedule."""
import json

import pytest

from peagle.errors import PeagleError
from peagle.spec_config import parse_spec_config, speculative_config


def cfg(**kw):
    return json.dumps({"method": "eagle3", "model": "h", "num_speculative_tokens": 3, **kw})


def test_auto_and_its_bound():
    s = parse_spec_config(cfg(num_speculative_tokens="auto"))
    assert s.auto and s.max_num_speculative_tokens is None and s.k_label == "auto"
    s = parse_spec_config(cfg(num_speculative_tokens="auto", max_num_speculative_tokens=6, parallel_drafting=True))
    assert s.auto and s.max_num_speculative_tokens == 6 and s.name == "peagle" and s.k_label == "auto<=6"
    assert parse_spec_config(s.as_dict()) == s
    assert speculative_config("h", "auto", True)["num_speculative_tokens"] == "auto"


def test_per_batch_size_schedule_as_vllm():
    s = parse_spec_config(cfg(num_speculative_tokens=5, num_speculative_tokens_per_batch_size=[[5, 64, 2], [1, 4, 5]]))
    assert not s.auto and s.num_speculative_tokens_per_batch_size == [[1, 4, 5], [5, 64, 2]]
    assert parse_spec_config(json.dumps(s.as_dict())) == s


@pytest.mark.parametrize("kw,msg", [
    ({"num_speculative_tokens": "automatic"}, "or \"auto\""),
    ({"max_num_speculative_tokens": 4}, "goes with"),
    ({"num_speculative_tokens": "auto", "max_num_speculative_tokens": 0}, "goes with"),
    ({"num_speculative_tokens": "auto", "num_speculative_tokens_per_batch_size": [[1, 8, 2]]}, "integer num_spec"),
    ({"num_speculative_tokens_per_batch_size": [[2, 8, 2]]}, "start at 1"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 2], [8, 9, 1]]}, "overlap"),
    ({"num_speculative_tokens": 33}, "1..32"),
    ({"num_speculative_tokens": "auto", "max_num_speculative_tokens": 33}, "goes with"),
    ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
])
def test_bad_configs_are_one_clear_error(kw, msg):
    with pytest.raises(PeagleError, match=msg):
        parse_spec_config(cfg(**kw))


def test_none_turns_speculation_off_everywhere():
    """`peagle serve` took "none" / "null" / "off" as no speculation; generate and LLM called it invalid JSON."""
    from peagle.spec_config import parse_spec_config
    for off in ("none", "NULL", " off ", ""):
        assert parse_spec_config(off) is None


def test_defaults_as_vllm():
    """An EAGLE-3 config without parallel_drafting is EAGLE-3 (vLLM's default false), K 32 is the largest taken,
    and as_dict() leaves peagle's default draft_sampling out (the dict vLLM gets is vLLM's)."""
    s = parse_spec_config(cfg(num_speculative_tokens=32))
    assert s.parallel_drafting is False and s.name == "eagle3" and s.num_speculative_tokens == 32
    assert s.as_dict() == {"method": "eagle3", "model": "h", "num_speculative_tokens": 32, "parallel_drafting": False}
    assert parse_spec_config(cfg(draft_sampling="argmax")).as_dict()["draft_sampling"] == "argmax"
