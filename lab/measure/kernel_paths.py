"""The C++ kernels' vector paths side by side: every projection of the default target's step (121 products), per
precision and row count, on the AVX2 path (impl 2), the AVX-512 one (impl 3) and the AMX one (impl 4: the 8-bit
activation products' integer dots on the tile unit) where the CPU has them, in one process, interleaved round by
round (min of the rounds). Every path gives the same bits (tests/test_quant.py); this prints what each costs and
the ratios (impl 0 takes AMX from ops.h's AMX_MIN_ROWS rows).

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/kernel_paths.py --quantizations none,q4a8,q4,q8

`--hot` adds each distinct product shape timed alone with its weights kept in cache, in multiply-adds per second
beside the whole step's: equal rates mean the step's products are bound by arithmetic, not by reading weights.

Each product is called from Python (the same overhead on both paths), weights as the target loads them; each
cell's timed pass follows an untimed one of the same cell (warm, as a decode loop re-reads its weights: without it
the first row count after another precision's pass ran cold and looked slower than the next).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags
from peagle.default_target import TARGET_DIR
from peagle.models import kernel_choice, quant_ext
from peagle.models import quant as Q
from peagle.models.llama import Transformer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=TARGET_DIR)
    ap.add_argument("--quantizations", default="none,q4a8,q4,q8")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hot", action="store_true", help="also time each distinct product shape alone, repeated "
                    "while its weights stay in cache, against the whole step's rate (compute- or memory-bound?)")
    a = ap.parse_args(argv)
    ext = quant_ext.get()
    if ext is None or not ext.has_avx2():
        print(f"needs the C++ kernels on an AVX2 CPU ({quant_ext.describe()})", file=sys.stderr)
        return 2
    impls = {"AVX2": 2} | ({"AVX-512": 3} if ext.has_avx512() else {}) | ({"AMX": 4} if ext.has_amx() else {})
    rows = [int(r) for r in a.rows.split(",")]
    targets = {q: Transformer.from_pretrained(a.model, quantization=q) for q in a.quantizations.split(",")}
    weights = {q: t._projections() for q, t in targets.items()}
    # impl 0's thresholds (peagle/models/kernel_choice.py: timed on each target's products at load, kept)
    chosen = {q: t.kernel_paths for q, t in targets.items() if t.kernel_paths}
    if chosen:
        impls["impl 0"] = 0
    gen = torch.Generator().manual_seed(0)
    xs = {m: {k: torch.randn(m, k, generator=gen) for k in {w.k for ws in weights.values() for w in ws}}
          for m in rows}
    best = {}
    for _ in range(a.rounds):
        for q, ws in weights.items():
            if targets[q].kernel_paths:               # impl 0 as this target alone would run it
                kernel_choice.activate(targets[q].kernel_paths)
            for m in rows:
                for name, impl in paths(q, impls):
                    for timed in (False, True):      # an untimed pass first: every cell warm, as in decoding
                        t0 = time.perf_counter()
                        for w in ws:
                            Q.qmm(xs[m][w.k], w, impl)
                        dt = time.perf_counter() - t0
                    best[q, m, name] = min(best.get((q, m, name), dt), dt)
    print(f"# The kernels' vector paths, every product of a step ({os.path.basename(a.model.rstrip('/'))})\n")
    print(f"CPU: {cpu_flags()}; {torch.get_num_threads()} threads; {quant_ext.describe()}; ms per step's "
          f"products, min of {a.rounds} interleaved rounds.\n")
    if chosen:
        print("impl 0 (what each target runs: AVX-512 except as listed; peagle/models/kernel_choice.py, timed on "
              "its products at load): " + "; ".join(f"{q}: {kernel_choice.summary(t)}" for q, t in chosen.items())
              + ".\n")
    names = list(impls)
    pairs = [(x, y) for x, y in (("AVX2", "AVX-512"), ("AVX-512", "AMX")) if x in impls and y in impls]
    fixed = [n for n in names if n != "impl 0"]
    print("| precision | rows | " + " | ".join(f"{n} (ms)" for n in names)
          + "".join(f" | {x} ÷ {y}" for x, y in pairs) + (" | impl 0 ÷ fastest path" if chosen else "") + " |")
    print("|---|---|" + "---|" * (len(names) + len(pairs) + bool(chosen)))
    for q in weights:
        for m in rows:
            cells = [f"{best[q, m, n] * 1e3:.1f}" if (q, m, n) in best else "-" for n in names]
            ratio = [f"{best[q, m, x] / best[q, m, y]:.2f}x" if (q, m, y) in best else "-" for x, y in pairs]
            if chosen:
                ratio.append(f"{best[q, m, 'impl 0'] / min(best[q, m, n] for n in fixed if (q, m, n) in best):.2f}x")
            print(f"| {q} | {m} | " + " | ".join(cells + ratio) + " |")
    if a.hot:
        hot_table(weights, best, impls, rows, xs, a.rounds)
    print(f"\nRegenerate: `OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python lab/measure/kernel_paths.py "
          f"--quantizations {a.quantizations} --rows {a.rows} --rounds {a.rounds}{' --hot' if a.hot else ''}`")
    return 0


def paths(q, impls):
    """The (name, impl) paths a precision's products take: the weight-only ones have no AMX path."""
    return [(name, impl) for name, impl in impls.items() if name != "AMX" or q.endswith("a8")]


def hot_table(weights, best, impls, rows, xs, rounds, calls=200):
    """Each distinct shape alone, `calls` products in a row (its weights stay in cache), best of `rounds`: its
    multiply-adds per second beside the whole step's (the products of every shape once, weights streamed). Equal
    rates say the step's products are bound by their arithmetic, not by reading the weights."""
    impls = {k: v for k, v in impls.items() if k != "impl 0"}          # the vector paths themselves
    print("\nHot products (GMAC/s: rows x outputs x inputs per second; µs per product, min of rounds):\n")
    shapes = sorted({(w.n, w.k) for ws in weights.values() for w in ws})
    print("| precision | rows | path | whole step | " + " | ".join(f"{n}x{k}" for n, k in shapes) + " |")
    print("|---|---|---|---|" + "---|" * len(shapes))
    for q, ws in weights.items():
        macs = sum(w.n * w.k for w in ws)
        one = {(w.n, w.k): w for w in ws}
        for m in rows:
            for name, impl in paths(q, impls):
                cells = []
                for shape in shapes:
                    w, dt = one[shape], float("inf")
                    for _ in range(rounds):
                        for _ in range(10):
                            Q.qmm(xs[m][w.k], w, impl)
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            Q.qmm(xs[m][w.k], w, impl)
                        dt = min(dt, (time.perf_counter() - t0) / calls)
                    cells.append(f"{m * w.n * w.k / dt / 1e9:.0f} ({dt * 1e6:.1f} µs)")
                print(f"| {q} | {m} | {name} | {m * macs / best[q, m, name] / 1e9:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
