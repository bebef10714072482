"""Whether a fresh process's first MKL vector-math call gives the bits of its second, without and with peagle's
warm-up (peagle/vml_init.py), and whether greedy decoding of the default target gives the same tokens in every
process.

Each arm runs --processes fresh processes on 2 threads: an MKL matrix product, then a float64 exp of 528,384
values twice (large enough for at::parallel_for to split it over the threads); "torch" imports torch alone,
"peagle" imports peagle first. The decode arm loads LLM() and decodes the demo's code prompt greedily.

    .venv/bin/python lab/measure/vml_first_call.py --out docs/benchmarks/vml-first-call.md
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys

from peagle.device import cpuinfo

EXP = """
import hashlib, torch{imp}
a = torch.randn(256, 576, generator=torch.Generator().manual_seed(0))
b = torch.randn(576, 1536, generator=torch.Generator().manual_seed(1))
(a @ b).sum()
x = torch.linspace(-20.0, 5.0, 528384, dtype=torch.float64)
first, second = x.exp(), x.exp()
print(int((first != second).sum()), hashlib.md5(first.numpy().tobytes()).hexdigest()[:8])
"""
DECODE = """
import hashlib
from peagle import LLM, SamplingParams
llm = LLM()
q = "Write a Python function that checks whether a string is a palindrome."
ids = llm.apply_chat_template([{"role": "user", "content": q}])
out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=200))[0].outputs[0].token_ids
print(0, hashlib.md5(str(list(out)).encode()).hexdigest()[:8])
"""


def run(script: str, n: int) -> list[tuple[int, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    seen = []
    for i in range(n):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        d, h = out.stdout.split()
        seen.append((int(d), h))
        print(f"  {i + 1}/{n}: {d} {h}", file=sys.stderr)
    return seen


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=12)
    ap.add_argument("--decode-processes", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, script in (("torch alone", EXP.format(imp="")), ("import peagle first", EXP.format(imp="\nimport peagle")),
                         ("LLM() greedy decode", DECODE)):
        n = args.decode_processes if script is DECODE else args.processes
        print(f"{name}: {n} processes", file=sys.stderr)
        seen = run(script, n)
        first_differs = sum(d > 0 for d, _ in seen)
        kinds = collections.Counter(h for _, h in seen)
        rows.append((name, n, "-" if script is DECODE else str(first_differs),
                     ", ".join(f"{h} x{c}" for h, c in kinds.most_common())))
    cpu = cpuinfo("model name") or "unknown CPU"
    lines = [f"# MKL's first vector-math call in fresh processes ({cpu}, {os.cpu_count()} CPUs, 2 threads)", "",
             "Regenerate: `.venv/bin/python lab/measure/vml_first_call.py --out docs/benchmarks/vml-first-call.md`",
             "", "| arm | processes | first exp != second | results (digest x processes) |", "|---|---|---|---|"]
    lines += [f"| {a} | {n} | {d} | {k} |" for a, n, d, k in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
