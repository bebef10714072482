"""Decoding tokens/s while other processes load the CPUs: peagle on a fixed 2 threads, a fixed 1 thread, and its
default (peagle/threads.py: fewer threads while others take a share of the cores), side by side in one run.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/shared_cpu.py --out docs/benchmarks/shared-cpu.md

Loads are processes beside peagle, each busy for a fraction of every 10 ms (1.0: a core's worth, like a second
job; 0.25: a light one). Per load, a warm-up run of every setting, then rounds alternating the settings; each
run generates --max-tokens greedy tokens (EOS ignored) for each of --prompts prompts one after the other, on the
default target (its default quantization), plain and with P-EAGLE K=1. tokens/s = tokens / wall time. With
--llama, llama.cpp on the same GGUF file (built into .venv-llama: lab/studies/llamacpp_vs_peagle.py), on the most
threads and on 1, gets the same prompts under the same loads: the peer a CPU user would run instead, its decode
time after the prompt's evaluation."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report

# a process busy for `duty` of every 10 ms, until its parent is gone
LOAD_CODE = ("import os, sys, time\nd, parent = float(sys.argv[1]), os.getppid()\nwhile os.getppid() == parent:\n"
             "    t = time.perf_counter()\n"
             "    while time.perf_counter() - t < d * 0.01:\n        pass\n    if d < 1:\n"
             "        time.sleep((1 - d) * 0.01)\n")
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.", "Explain prime numbers to a child.",
           "List three facts about the moon.", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\""]


def parse_loads(s: str) -> list[tuple[float, ...]]:
    """"0/1/0.5/1,1" -> [(), (1.0,), (0.5,), (1.0, 1.0)]: per load, the duty of each busy process."""
    out = []
    for part in s.split("/"):
        duties = tuple(float(x) for x in part.split(",") if float(x) > 0)
        if any(not 0 < d <= 1 for d in duties):
            raise SystemExit(f"--loads: a duty is in (0, 1], got {part!r}")
        out.append(duties)
    return out


def load_name(duties: tuple) -> str:
    return "none" if not duties else " + ".join(f"{d:g} core" for d in duties)


def start_load(duties: tuple) -> list:
    return [subprocess.Popen([sys.executable, "-c", LOAD_CODE, str(d)]) for d in duties]


def main(argv=None) -> int:
    import torch

    from lab.studies.llamacpp_vs_peagle import LLAMA_PY, run_llama
    from peagle.default_target import gguf_path
    from peagle.llm import DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
    from peagle.sampling import SamplingParams
    from peagle.spec_config import speculative_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0/0.25/0.5/1/1,1", help="'/'-separated loads, each ','-separated duties")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="the most threads (the fixed setting's count)")
    ap.add_argument("--llama", action="store_true", help="llama.cpp as a peer (needs .venv-llama)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    loads = parse_loads(a.loads)
    if a.llama and not os.path.isfile(LLAMA_PY):
        raise SystemExit(f"--llama: no {LLAMA_PY} (see lab/studies/llamacpp_vs_peagle.py)")
    torch.set_num_threads(a.threads)
    base = LLM(DEFAULT_MODEL, max_num_seqs=1)
    spec = base.with_speculative_config(speculative_config(DEFAULT_PEAGLE_HEAD, 1, True))
    tok = base.get_tokenizer()
    ids = [tok.encode(p) for p in (PROMPTS * a.prompts)[:a.prompts]]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    settings = {f"{a.threads} threads": a.threads, "1 thread": 1, "adaptive (default)": None}
    engines = {"plain": base, "P-EAGLE K=1": spec}

    def run(llm, threads):
        gov = llm.engine.threads
        gov.on = threads is None                   # fixed settings: the governor off, torch's count set here
        torch.set_num_threads(threads or gov.threads)
        t0 = time.perf_counter()
        outs = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p in ids]
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs

    for llm in engines.values():                 # the governor's ceiling: the fixed count
        torch.set_num_threads(a.threads)
        llm.engine.threads.ceiling = llm.engine.threads.threads = a.threads
    ref = {name: run(llm, a.threads)[1] for name, llm in engines.items()}
    rows, same = [], True
    for duties in loads:
        procs = start_load(duties)
        try:
            time.sleep(0.5)
            rates = {(m, s): [] for m in engines for s in settings}
            llama = {a.threads: [], 1: []}
            for r in range(a.rounds + 1):                        # round 0: warm-up, untimed
                for m, llm in engines.items():
                    for s, n in settings.items():
                        x, outs = run(llm, n)
                        same &= outs == ref[m]
                        if r:
                            rates[(m, s)].append(x)
                for n in (llama if a.llama else ()):
                    res = run_llama(gguf_path(), ids, a.max_tokens, n)
                    if r:
                        llama[n].append(sum(len(x["ids"]) for x in res) / sum(x["decode_s"] for x in res))
            gov = {m: (llm.engine.threads.threads, llm.engine.threads.switches) for m, llm in engines.items()}
        finally:
            for p in procs:
                p.kill()
        for m in engines:
            med = {s: statistics.median(rates[(m, s)]) for s in settings}
            fixed = [med[s] for s, n in settings.items() if n is not None]
            ad = med["adaptive (default)"]
            rows.append(f"| {load_name(duties)} | {m} | " + " | ".join(f"{med[s]:.1f}" for s in settings) +
                        f" | {ad / med[f'{a.threads} threads']:.2f}x | {ad / max(fixed):.2f}x | "
                        f"{gov[m][0]} ({gov[m][1]}) |" +
                        "".join(f" {statistics.median(v):.1f} |" for v in llama.values() if a.llama))
        print(rows[-2] + "\n" + rows[-1], flush=True)
    head = ["| load beside peagle | decoding | " + " | ".join(f"{s} tok/s" for s in settings) +
            f" | adaptive ÷ {a.threads} threads | adaptive ÷ best fixed | adaptive's threads at the end "
            "(switches so far) |" + (f" llama.cpp plain, {a.threads} threads tok/s | llama.cpp plain, 1 thread tok/s |"
                                     if a.llama else ""), "|---" * (5 + len(settings) + 2 * a.llama) + "|"]
    precision = getattr(base.engine.target, "precision", "float weights").split(":")[0]
    lines = [f"# Decoding beside other processes ({cpu_flags()}, {os.cpu_count()} CPUs)", "",
             f"Default target, {precision}; {a.prompts} prompts x {a.max_tokens} "
             f"greedy tokens one after the other; median of {a.rounds} rounds alternating the settings, after a "
             "warm-up round; a load of d core is a process busy for d of every 10 ms.", ""] + head + rows + [
             "", f"Every run's tokens equal the quiet {a.threads}-thread run's: {'yes' if same else 'NO'}."]
    return write_report(lines, ".venv/bin/python lab/measure/shared_cpu.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
