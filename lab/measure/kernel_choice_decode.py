"""Plain decoding through peagle's engine with impl 0's AVX2 / AVX-512 thresholds as timed on this CPU
(peagle/models/kernel_choice.py) against AVX-512 at every row count (what impl 0 took before), in one process,
interleaved round by round on the same target; median tokens/s per setting, the ratio, and whether the greedy
tokens agree (they must: every path gives the same bits).

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/kernel_choice_decode.py --quantization q4a8 --rounds 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags
from peagle import LLM, SamplingParams
from peagle.default_target import TARGET_DIR

PROMPTS = ["def fibonacci(n):", "Explain the difference between a list and a tuple in Python.",
           "Write a haiku about the sea.", "import numpy as np\n\ndef normalize(x):"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=TARGET_DIR)
    ap.add_argument("--quantization", default="q4a8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    llm = LLM(model=a.model, quantization=a.quantization)
    target = llm.engine.target
    timed = target.kernel_paths
    if not timed:
        print("nothing to compare: no AVX-512 kernel choice on this CPU / target", file=sys.stderr)
        return 2
    settings = {"timed here": timed, "AVX-512 throughout": {k: 1 for k in timed}}
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    rates: dict = {n: [] for n in settings}
    tokens: dict = {}
    for _ in range(a.rounds):
        for name, th in settings.items():
            target.kernel_paths = th               # the target sets its thresholds before each forward
            n, t0 = 0, time.perf_counter()
            for p in PROMPTS:
                out = llm.generate([p], sp)[0].outputs[0].token_ids
                n += len(out)
                tokens.setdefault(name, []).append(list(out))
            rates[name].append(n / (time.perf_counter() - t0))
    target.kernel_paths = timed
    med = {n: statistics.median(v) for n, v in rates.items()}
    same = all(x == y for x, y in zip(*tokens.values()))
    import torch
    print(f"# Plain decoding, impl 0's kernel paths as timed vs AVX-512 throughout ({a.quantization})\n")
    print(f"CPU: {cpu_flags()}; {torch.get_num_threads()} threads; {len(PROMPTS)} prompts x {a.max_tokens} tokens "
          f"one after another, greedy; median of {a.rounds} interleaved rounds.\n")
    print(f"Timed thresholds: {timed} (AVX2 below that many rows).\n")
    print("| setting | tok/s (median) | rounds |")
    print("|---|---|---|")
    for n, v in rates.items():
        print(f"| {n} | {med[n]:.1f} | {', '.join(f'{x:.0f}' for x in v)} |")
    names = list(settings)
    print(f"\n{names[0]} ÷ {names[1]}: **{med[names[0]] / med[names[1]]:.2f}x**; greedy tokens identical: {same}")
    print(f"\nRegenerate: `OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python lab/measure/kernel_choice_decode.py "
          f"--quantization {a.quantization} --max-tokens {a.max_tokens} --rounds {a.rounds}`")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
