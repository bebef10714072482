"""peagle/threads.py: a step gives the same bits on any thread count (the default target in every precision, a
speculative run whose thread count flips every step), and the governor gives a thread up while another process
keeps a core busy and takes it back when it stops."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.threads import BUSY, PROBE, QUIET, ThreadGovernor, busy_seconds, choose, others_busy

SPIN = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 60:\n    pass\n"
CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
two_cpus = pytest.mark.skipif(len(CPUS) < 2 or busy_seconds(CPUS) is None, reason="needs 2 CPUs and /proc/stat")


def quiet_or_skip(seconds=0.4):
    """These tests read the machine's load: skip (not fail) where other processes keep its CPUs busy."""
    others = others_busy(seconds)
    if others > QUIET / 2:
        pytest.skip(f"other processes keep {others:.2f} CPUs busy")


@pytest.fixture
def threads():
    """Restores torch's thread count (tests run on one: conftest.py)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("others,cores,ceiling,want", [
    (0.0, 2, 2, 2), (QUIET - 0.01, 2, 2, 2), (QUIET, 2, 2, None), (BUSY - 0.01, 2, 2, None), (BUSY, 2, 2, 1),
    (1.9, 2, 2, 1), (1.0, 2, 1, 1), (0.5, 2, 1, 1),          # one thread: nothing to choose
    (8.1, 16, 8, 8), (8.5, 16, 8, None), (9.0, 16, 8, 7), (10.5, 16, 8, 5), (30.0, 16, 4, 1)])
def test_choose(others, cores, ceiling, want):
    assert choose(others, cores, ceiling) == want


def test_measuring_takes_the_count_whose_steps_cost_less(threads):
    """Between QUIET and BUSY: a window on each count, then the one whose steps of the shapes both ran cost less
    (weighted by how often each shape ran), the other measured again after PROBE s or when no shape is shared."""
    torch.set_num_threads(2)
    gov = ThreadGovernor(log=lambda s: None)
    two = {(1, 1, False): (0.40, 100), (1, 0, False): (0.05, 10)}         # 4 ms and 5 ms steps on 2 threads
    one = {(1, 1, False): (0.30, 100), (16, 1, False): (1.0, 10)}         # 3 ms on 1; a shape 2 threads did not run
    assert gov.measure(two, 0.0) == 1                       # 1 thread not measured yet: its window next
    gov.threads = 1
    assert gov.measure(one, 0.3) == 1                       # the shared shape: 3 ms on 1 against 4 on 2
    assert gov.measure(one, 0.6) == 1
    assert gov.measure(one, PROBE + 0.1) == 2               # 2 threads' figure is stale: measured again
    gov.threads = 2
    assert gov.measure({(1, 1, False): (0.25, 100)}, PROBE + 0.4) == 2    # now 2 threads win (2.5 ms)
    assert gov.measure({(1, 1, False): (0.35, 100)}, PROBE + 0.5) == 1    # ... until they fall behind 1's 3 ms
    assert gov.every[2] == 2 * PROBE and gov.every[1] == PROBE       # the loser is measured half as often
    gov.threads = 1
    assert gov.measure({(4, 2, False): (0.3, 10)}, PROBE + 0.6) == 2      # nothing shared with 2's window
    torch.set_num_threads(4)                                # a ceiling of 4: the pair is 4 and 3
    gov = ThreadGovernor(log=lambda s: None)
    assert gov.measure(two, 0.0) == 3                       # 4 measured, 3 not yet
    gov.threads = 1                                         # a busy spell took it to 1: 3 is still to measure
    assert gov.measure(one, 0.3) == 3


@two_cpus
def test_busy_seconds_see_another_process():
    child = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        others = others_busy(0.8)
    finally:
        child.kill()
    assert others > 0.5                                 # the child's core (it starts in ~0.1 s)
    assert busy_seconds({max(CPUS) + 1000}) is None     # a CPU /proc/stat does not list


@two_cpus
def test_governor_gives_a_thread_up_beside_a_busy_process_and_takes_it_back(threads, monkeypatch):
    monkeypatch.delenv("PEAGLE_THREADS", raising=False)
    quiet_or_skip()
    torch.set_num_threads(2)
    said = []
    gov = ThreadGovernor(log=said.append)
    assert gov.on and gov.ceiling == 2

    def tick_until(n, seconds=4.0):
        end = time.monotonic() + seconds
        while time.monotonic() < end and gov.tick() != n:
            time.sleep(0.02)
        return gov.threads

    assert tick_until(1, 1.0) == 2                       # a quiet machine: stays on 2
    child = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        assert tick_until(1) == 1 and torch.get_num_threads() == 1
        assert len(said) == 1 and "stepping on 1 of 2 threads" in said[0]
    finally:
        child.kill()
        child.wait()
    assert tick_until(2) == 2 and torch.get_num_threads() == 2 and gov.switches == 2
    torch.set_num_threads(1)                             # the caller's own count: the new ceiling
    assert gov.tick() == 1 and gov.ceiling == 1


@two_cpus
def test_what_others_ran_while_no_step_ran_is_not_counted(threads, monkeypatch):
    """A pause between steps (rest, then a tick after IDLE) starts a new window: a busy process during the
    pause only does not take a thread (without the restart it did: the window's reading would include it)."""
    monkeypatch.delenv("PEAGLE_THREADS", raising=False)
    quiet_or_skip()
    torch.set_num_threads(2)
    gov = ThreadGovernor(log=lambda s: None)
    gov.tick()
    gov.rest()
    child = subprocess.Popen([sys.executable, "-c", SPIN])
    time.sleep(0.6)
    child.kill()
    child.wait()
    end = time.monotonic() + 0.8
    while time.monotonic() < end:
        assert gov.tick() == 2
        time.sleep(0.01)


def test_fixed_keeps_the_count(threads, monkeypatch):
    monkeypatch.setenv("PEAGLE_THREADS", "fixed")
    torch.set_num_threads(2)
    gov = ThreadGovernor(log=lambda s: None)
    assert not gov.on and gov.tick() == 2


@pytest.fixture(scope="module")
def smollm2():
    from peagle.default_target import ensure
    return ensure(verbose=False)


@pytest.mark.parametrize("quantization", ["q4a8", "q8a8", "q4", "q8", "none"])
def test_the_default_targets_forward_is_the_same_on_1_and_2_threads(smollm2, quantization, threads):
    """A prefill of 40 tokens, then a verify block of 6 (logits and the cache), bit for bit."""
    t = LLM(smollm2, quantization=quantization, max_num_seqs=1).engine.target
    g = torch.Generator().manual_seed(5)
    prompt, block = torch.randint(5, 40000, (1, 40), generator=g), torch.randint(5, 40000, (1, 6), generator=g)
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        c = t.new_cache(1, 64)
        a = t.forward(prompt, c, 0, torch.tensor([0]), (2, 15), span=40, s0=0)
        b = t.forward(block, c, 0, torch.tensor([40]), (2, 15), span=46, s0=40)
        outs.append([a[0], a[1], b[0], b[1], c.k[3][:, :, :46], c.v[29][:, :, :46]])
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_a_speculative_run_flipping_threads_every_step_gives_the_same_output(smollm2, threads):
    """P-EAGLE K=3 with the shipped head, greedy and seeded sampling: every step on the other thread count than
    the one before gives the 1-thread run's tokens and acceptance."""
    from peagle.llm import DEFAULT_PEAGLE_HEAD
    cfg = {"method": "eagle3", "model": DEFAULT_PEAGLE_HEAD, "num_speculative_tokens": 3, "parallel_drafting": True}
    llm = LLM(smollm2, speculative_config=cfg, max_num_seqs=2)
    prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": q}])}
               for q in ("Write a Python function that reverses a string.", "Name three rivers in Europe.")]
    sps = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=0.8, max_tokens=40, seed=11, ignore_eos=True)]

    def run():
        llm.engine.metrics.reset()
        out = [[o.outputs[0].token_ids for o in llm.generate(prompts, sp)] for sp in sps]
        return out, llm.get_metrics()["num_accepted_tokens_per_pos"]

    torch.set_num_threads(1)
    llm.engine.threads.on = False
    ref = run()
    seen = []

    def flip():
        torch.set_num_threads(3 - torch.get_num_threads())
        seen.append(torch.get_num_threads())
        return seen[-1]
    llm.engine.threads.tick = flip
    assert run() == ref and ref[1][0] > 0
    assert seen.count(1) > 5 and seen.count(2) > 5
