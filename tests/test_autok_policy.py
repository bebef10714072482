"""K policies: vLLM 0.32's num_speculative_tokens_per_batch_size, read as vLLM reads it."""
import pytest

from peagle.kpolicy import BatchSizeSchedule, FixedK, validate_schedule


def test_schedule_lookup_like_vllm():
    p = BatchSizeSchedule([[32, 128, 2], [1, 16, 3]], k_max=7)
    # inside a range its K; in a gap the K of the range before; past the last range the last K
    assert [p.k_for(b) for b in (1, 16, 17, 31, 32, 128, 500)] == [3, 3, 3, 3, 2, 2, 2]
    assert BatchSizeSchedule([[1, 4, 9], [5, 8, 0]], k_max=5).k_for(2) == 5       # capped by the max K
    assert BatchSizeSchedule([[1, 4, 9], [5, 8, 0]], k_max=5).k_for(6) == 0       # K = 0 allowed
    assert p.describe()["schedule"] == [[1, 16, 3], [32, 128, 2]]
    assert FixedK(4).choose([object()] * 3) == 4
    sched = BatchSizeSchedule([[1, 2, 5], [3, 8, 0]], k_max=5)
    assert sched.drafts_next(2) and not sched.drafts_next(3)     # K = 0 ahead: prompts wait for the catch-up


@pytest.mark.parametrize("bad,msg", [
    ([], "non-empty"), ("1,2,3", "non-empty"), ([[1, 2]], "3 integers"), ([[1, 2, 1.5]], "3 integers"),
    ([[0, 2, 1]], "positive"), ([[3, 2, 1]], "start <= end"), ([[1, 2, -1]], ">= 0"),
    ([[1, 4, 1], [4, 8, 2]], "overlap"), ([[2, 4, 1]], "start at 1"),
    ([[1, True, 2]], "3 integers"), ([[1, 8, False]], "3 integers")])   # JSON true/false are not integers
def test_schedule_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        validate_schedule(bad)


def test_a_range_of_one_batch_size_is_valid():
    """vLLM's ranges are inclusive: [1, 1, K] covers batch size 1 alone (start == end is not a bad range)."""
    assert validate_schedule([[2, 8, 3], [1, 1, 7]]) == [(1, 1, 7), (2, 8, 3)]
    p = BatchSizeSchedule([[1, 1, 7], [2, 2, 4], [3, 64, 0]], k_max=7)
    assert [p.k_for(b) for b in (1, 2, 3, 100)] == [7, 4, 0, 0]
