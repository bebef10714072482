"""lab/measure/slow_start.py: the step clock times every decode step and nothing else, the ring's cold reads walk
the ring, and a whole (tiny) run reports its three tables with every case."""
import time

import pytest

from lab.measure import slow_start
from peagle.llm import LLM
from peagle.sampling import SamplingParams


def test_the_step_clock_times_each_step_and_not_what_runs_before_it(target):
    llm = LLM(model=target)
    clock = slow_start.StepClock(llm.engine)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(clock.times) == 5                  # the prefill samples the first token, 5 decode steps the rest
    clock.times.clear()
    clock.before = lambda: time.sleep(0.05)       # a gap before each step: run, but outside the step's time
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert time.perf_counter() - t0 >= 5 * 0.05
    assert len(clock.times) == 5 and max(clock.times) < 0.025     # a tiny target's step: about a millisecond


def test_cold_reads_walk_the_ring_and_warm_reads_stay_put():
    ring = slow_start.Ring(1, 4)
    assert ring.buf.numel() == 4 * 2**18 and ring.n == 2**18
    starts = []
    for _ in range(5):
        ring.cold()
        starts.append(ring.pos - ring.n)
    assert starts == [0, 2**18, 2**19, 3 * 2**18, 0]
    ring.warm()
    assert ring.pos == 2**18                      # a warm read moves nothing


def test_bins_are_medians_of_per_step_medians():
    """Per-step medians over the requests (2, 2, 3, 4 ms), then each block's median: 2 and 3.5 (the medians of
    each request's block medians would be 2.5 and 4.5, block means of the per-step means 3.17 and 4.17)."""
    curves = [[0.001, 0.002, 0.003, 0.004], [0.003, 0.002, 0.001, 0.008], [0.002, 0.009, 0.009, 0.0]]
    assert slow_start.bins(curves, 2) == pytest.approx([2.0, 3.5])


def test_a_tiny_run_reports_its_three_tables(target, tmp_path):
    out = tmp_path / "r.md"
    slow_start.main(["--model", target, "--prompt-lens", "1,4", "--tokens", "8", "--rounds", "2", "--bin", "4",
                     "--gap-ms", "2", "--read-mb", "1", "--between-mb", "0.5", "--ring-mb", "2", "--skip", "2",
                     "--out", str(out)])
    text = out.read_text()
    for row in ("| N = 1 |", "| N = 4 |", "| nothing |", "| sleep 2 ms |", "| compute 2 ms (data in L2) |",
                "| one read of 1 MB |", "| reads for 2 ms (0.5 MB blocks of a 2 MB ring) |",
                "| a prefill of 4 tokens |", "| busy-wait 0.5 ms |", "| read 0.5 MB, the same each time |",
                "| read 0.5 MB, the next of a 2 MB ring |"):
        assert row in text, row
    assert text.count("| nothing |") == 2 and "Regenerate: `" in text
