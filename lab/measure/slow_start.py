"""Why a decode step costs more after anything else: the plain step's slow start after a prefill or a gap, and
the cost of what runs between steps (issue 38 / 39 / 40: why a speculative step's target calls cost more than a
plain step's, and why the first plain steps of a request misprice plain decoding for auto K).

Plain greedy decoding of one request at a time on the default target (q4a8 unless --quantization says
otherwise), every engine decode step timed (the engine's `_decode`, wall clock). Three tables, one process:
1. after a prefill of N random tokens (N = --prompt-lens): each decode step's median over --rounds requests, in
   blocks of --bin steps;
2. a 1-token request right after something else (--gap-ms of sleep; --gap-ms of compute on data that stays in
   the cores' L2, on every thread; one pass over --read-mb of memory; --gap-ms of reading memory; the same
   target's prefill of the last --prompt-lens into a scratch cache), in blocks as 1;
3. steady decoding with something between every two steps (a busy-wait of --spin-ms; a read of --between-mb,
   the same buffer each time or the next one of a ring in --ring-mb), the median step from step --skip on.
Cases alternate within each round, in reverse order every other round; the first round is untimed.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/slow_start.py --out docs/benchmarks/slow-start.md

Quick check that it runs (numbers meaningless): --prompt-lens 1,4 --tokens 16 --rounds 2 --gap-ms 2 --read-mb 4
--between-mb 1 --ring-mb 4 --skip 4.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report
from peagle.llm import DEFAULT_MODEL, LLM
from peagle.sampling import SamplingParams


class StepClock:
    """Wraps an engine's decode step; `times` holds the wall seconds of the steps since the last clear();
    `before`, when set, runs before each step, outside its time."""

    def __init__(self, engine):
        self.times: list[float] = []
        self.before = None
        self._decode = engine._decode
        engine._decode = self

    def __call__(self):
        if self.before is not None:
            self.before()
        t0 = time.perf_counter()
        out = self._decode()
        self.times.append(time.perf_counter() - t0)
        return out


def for_seconds(seconds: float, fn=lambda: None):
    """fn() again and again for `seconds` (no fn: a busy-wait)."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()


class Ring:
    """Reads of `mb` MB: the same block each time (warm) or the next block of a ring of `ring_mb` (cold)."""

    def __init__(self, mb: float, ring_mb: float):
        self.n = max(1, int(mb * 2**20 / 4))
        self.buf = torch.ones(max(self.n, int(ring_mb * 2**20 / 4)))
        self.pos = 0

    def warm(self):
        self.buf[: self.n].sum()

    def cold(self):
        if self.pos + self.n > self.buf.numel():
            self.pos = 0
        self.buf[self.pos: self.pos + self.n].sum()
        self.pos += self.n


def bins(curves: list[list[float]], width: int) -> list[float]:
    """Per-step medians over requests (ms), then the median of each block of `width` steps."""
    n = min(map(len, curves))
    med = [statistics.median(c[i] for c in curves) * 1e3 for i in range(n)]
    return [statistics.median(med[i: i + width]) for i in range(0, n, width)]


def run_cases(llm, clock, cases: dict, ids_for, params, rounds: int, between: bool = False) -> dict:
    """cases: name -> a callable run right before the request (between: before every decode step, outside its
    time); params: the requests' SamplingParams, or a dict of them per case; -> name -> list of per-step times
    per round."""
    out = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ids = ids_for(name)
            if between:
                clock.before = cases[name]
            else:
                cases[name]()
            clock.times.clear()
            llm.generate([{"prompt_token_ids": ids}], params[name] if isinstance(params, dict) else params)
            if r:
                out[name].append(list(clock.times))
    clock.before = None
    return out


def bin_table(title: str, res: dict, width: int) -> list[str]:
    rows = {name: bins(c, width) for name, c in res.items()}
    nb = min(map(len, rows.values()))
    steps = min(len(x) for c in res.values() for x in c)            # decode steps per request (the first token
    head = [f"{i * width + 1}-{min((i + 1) * width, steps)}" for i in range(nb)]   # comes from the prefill)
    lines = [f"| {title} | " + " | ".join(head) + " | first ÷ last block |", "|---|" + "---|" * (nb + 1)]
    for name, b in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in b[:nb]) + f" | {b[0] / b[nb - 1]:.2f}x |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--prompt-lens", default="1,32,256", help="prompt lengths of table 1 (the last: table 2's prefill)")
    p.add_argument("--tokens", type=int, default=96, help="tokens decoded per request")
    p.add_argument("--bin", type=int, default=8, help="steps per block in tables 1 and 2")
    p.add_argument("--rounds", type=int, default=9, help="rounds (the first untimed)")
    p.add_argument("--gap-ms", type=float, default=150.0, help="table 2: the sleep's, the compute's and the reads' length")
    p.add_argument("--read-mb", type=float, default=200.0, help="table 2: the memory read's size")
    p.add_argument("--spin-ms", type=float, default=0.5, help="table 3: the busy-wait between steps")
    p.add_argument("--between-mb", type=float, default=14.0, help="table 3: the read between steps (about a "
                   "P-EAGLE head's bytes per pass); table 2: the reads' block")
    p.add_argument("--ring-mb", type=float, default=1024.0, help="tables 2 and 3: the ring the cold reads walk")
    p.add_argument("--skip", type=int, default=50, help="table 3: steps left out at a request's start")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    llm = LLM(model=a.model, quantization=a.quantization)
    target = llm.engine.target
    clock = StepClock(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    vocab = target.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def random_ids(n):
        return torch.randint(min(100, vocab - 1), vocab, (n,), generator=gen).tolist()

    lens = [int(x) for x in a.prompt_lens.split(",")]
    nothing = lambda: None
    t1 = run_cases(llm, clock, {f"N = {n}": nothing for n in lens}, lambda name: random_ids(int(name[4:])),
                   params, a.rounds)

    x, y = torch.randn(2**18), torch.empty(2**18)      # 1 MB each: sin over them stays in the cores' L2 (on a
                                                        # 2-core Xeon: 1.98 CPU-seconds per second)
    block = Ring(a.read_mb, a.read_mb)
    stream = Ring(a.between_mb, a.ring_mb)
    scratch = target.new_cache(1, lens[-1] + 1)

    def prefill():
        target.forward(torch.tensor([random_ids(lens[-1])]), scratch, 0, torch.zeros(1, dtype=torch.long),
                       logits_at=torch.tensor([lens[-1] - 1]), span=lens[-1])   # as the engine's prefill

    g = a.gap_ms / 1e3
    gaps = {"nothing": nothing, f"sleep {a.gap_ms:g} ms": lambda: time.sleep(g),
            f"compute {a.gap_ms:g} ms (data in L2)": lambda: for_seconds(g, lambda: torch.sin(x, out=y)),
            f"one read of {a.read_mb:g} MB": block.cold,
            f"reads for {a.gap_ms:g} ms ({a.between_mb:g} MB blocks of a {a.ring_mb:g} MB ring)":
                lambda: for_seconds(g, stream.cold),
            f"a prefill of {lens[-1]} tokens": prefill}
    t2 = run_cases(llm, clock, gaps, lambda name: random_ids(1), params, a.rounds)

    ring = stream                                # table 2's ring of between-mb blocks
    s = a.spin_ms / 1e3
    between = {"nothing": nothing, f"busy-wait {a.spin_ms:g} ms": lambda: for_seconds(s),
               f"read {a.between_mb:g} MB, the same each time": ring.warm,
               f"read {a.between_mb:g} MB, the next of a {a.ring_mb:g} MB ring": ring.cold}
    gap_ms = {}
    for name, fn in between.items():
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        gap_ms[name] = (time.perf_counter() - t0) / 5 * 1e3
    t3 = {name: [statistics.median(c[a.skip:] or c) * 1e3 for c in curves] for name, curves in
          run_cases(llm, clock, between, lambda name: random_ids(32), params, a.rounds, between=True).items()}
    base = statistics.median(t3["nothing"])

    name = os.path.basename(a.model.rstrip("/"))
    lines = [f"# A decode step's slow start, and what runs between steps ({name}, {target.precision})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; plain greedy "
             f"decoding, one request at a time, {a.tokens} tokens each; every engine decode step timed; medians "
             f"over {a.rounds - 1} timed rounds (cases alternating, reversed every other round).", "",
             f"**1. After a prefill of N random tokens** (ms per decode step; per-step medians over the requests, "
             f"then the median of each block of {a.bin} steps):", ""]
    lines += bin_table("prompt", t1, a.bin)
    lines += ["", f"**2. A 1-token request right after something else** (ms per decode step, as in 1; the compute "
              f"is y = sin(x) over 1 MB on every torch thread, data in the cores' L2; the read is one pass over a buffer "
              f"touched only by these reads, the reads for {a.gap_ms:g} ms stream a ring of {a.ring_mb:g} MB block by "
              f"block; the prefill is the target's own forward of {lens[-1]} random tokens "
              "into a scratch cache):", ""]
    lines += bin_table("before the request", t2, a.bin)
    lines += ["", f"**3. Something between every two decode steps** (a 32-token prompt, the median step from step "
              f"{a.skip + 1} on; the thing between is not in the step's time):", "",
              "| between steps | its time (ms) | step (ms) | ÷ nothing between |", "|---|---|---|---|"]
    for name, xs in t3.items():
        m = statistics.median(xs)
        lines.append(f"| {name} | {gap_ms[name]:.3f} | {m:.3f} | {m / base:.2f}x |")
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/slow_start.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
