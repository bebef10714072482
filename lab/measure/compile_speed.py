"""`--compile` on or off: steady-state decode tokens/s at batch 1, eager vs torch.compile, side by side.

Each mode gets its own LLM. The first generate() of each (the compile warm-up: graphs for the prefill and the
decode / verify / draft shapes of a run) is timed and reported apart; then the modes are timed interleaved,
--repeats times over the same prompts, medians reported with the ratio, and the greedy tokens compared
(compiled outputs must equal eager ones).

    .venv/bin/python lab/measure/compile_speed.py --threads 2 --repeats 3 --prompts 4
    .venv/bin/python lab/measure/compile_speed.py --method peagle     # with the shipped P-EAGLE head, K = 7
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from peagle import LLM, SamplingParams
from peagle.bench.runner import Bench
from peagle.data.benchmarks import load_dataset
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
from peagle.spec_config import speculative_config


def timed(llm, prompts, sp):
    t0, toks = time.perf_counter(), []
    for p in prompts:
        toks.append(llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids)
    return sum(map(len, toks)) / (time.perf_counter() - t0), toks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--method", choices=["plain", "eagle3", "peagle"], default="plain")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = None
    if a.method != "plain":
        head = DEFAULT_PEAGLE_HEAD if a.method == "peagle" else DEFAULT_EAGLE3_HEAD
        spec = speculative_config(head, a.k, a.method == "peagle")
    enc = Bench(a.model, {})
    prompts = [enc.encode(p) for p in load_dataset("humaneval", a.prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llms, warm, rates, outs = {}, {}, {"eager": [], "compile": []}, {}
    for mode in rates:
        llms[mode] = LLM(a.model, speculative_config=spec, compile=mode == "compile", quantization="none")
        t0 = time.perf_counter()
        timed(llms[mode], prompts, sp)
        warm[mode] = time.perf_counter() - t0
        print(f"{mode}: first pass (warm-up{' + compilation' if mode == 'compile' else ''}) {warm[mode]:.1f} s", flush=True)
    for r in range(a.repeats):
        for mode, llm in llms.items():
            tps, outs[mode] = timed(llm, prompts, sp)
            rates[mode].append(tps)
            print(f"  repeat {r + 1} {mode}: {tps:.1f} tok/s", flush=True)
    e, c = statistics.median(rates["eager"]), statistics.median(rates["compile"])
    print(f"\n# {a.method}{'' if a.method == 'plain' else f' K={a.k}'}, batch 1, {len(prompts)} HumanEval prompts x "
          f"{a.max_tokens} tokens, {a.threads} threads, medians of {a.repeats}")
    print("| mode | first pass s | tok/s | ratio |\n|---|---|---|---|")
    print(f"| eager | {warm['eager']:.1f} | {e:.1f} | 1.00x |")
    print(f"| compile | {warm['compile']:.1f} | {c:.1f} | {c / e:.2f}x |")
    print(f"greedy tokens identical: {outs['eager'] == outs['compile']}")
    print("command: python lab/measure/compile_speed.py " + shlex.join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
