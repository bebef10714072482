"""--compile: the engine's compile-mode shapes (bucketed spans, no host-keyed fast paths) keep greedy outputs
identical to plain decoding; with torch.compile itself (slow: minutes of compilation on a CPU) too."""
import pytest
from heads import save_random_head

from peagle import LLM, SamplingParams
from peagle.compile import SPAN_BUCKET, bucket

SP = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(5, 40)), [7]]


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    t = tiny_dirs["llama"]
    head = save_random_head(t, str(tmp_path_factory.mktemp("compile") / "p"), layers=1)
    ref = [o.outputs[0].token_ids for o in LLM(t).generate(PROMPTS, SP)]
    return t, {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "parallel_drafting": True}, ref


def test_bucket():
    assert [bucket(n) for n in (1, SPAN_BUCKET, SPAN_BUCKET + 1)] == [SPAN_BUCKET, SPAN_BUCKET, 2 * SPAN_BUCKET]


@pytest.mark.parametrize("speculative", [False, True])
def test_compile_mode_shapes_keep_greedy_identical(setup, speculative):
    t, spec, ref = setup
    llm = LLM(t, speculative_config=spec if speculative else None, max_num_seqs=3, max_model_len=80)
    llm.engine.compiled = True              # the compile-mode shapes, without paying for torch.compile
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)] == ref


@pytest.mark.slow
def test_torch_compile_keeps_greedy_identical(setup):
    t, spec, ref = setup
    for s in (None, spec):
        llm = LLM(t, speculative_config=s, compile=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)] == ref
