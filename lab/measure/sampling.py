"""Speculation under sampling: argmax drafts vs drafts sampled from the drafter's q (docs/sampling.md).

For each temperature, concurrency and method the runs are interleaved: plain decoding, then each head with
`"draft_sampling": "argmax"` (vLLM's one-hot drafts, accepted with probability p(draft)) and `"sample"`
(drafts drawn from q, accepted with min(1, p/q), rejections resampled from (p - q)+). Every run generates
exactly --output-len tokens per prompt (EOS ignored) so tokens/s compare like for like; the median wall time
of --repeats is reported. Printed per cell: output tokens/s, speedup over plain decoding at the same
temperature, mean acceptance length (AL) and per-position acceptance rates. At T=0 both modes are the same
greedy path (sample mode only applies to rows with temperature > 0), so T=0 has one row per head.

    .venv/bin/python lab/measure/sampling.py                                  # default target (SmolLM2) + its heads
    .venv/bin/python lab/measure/sampling.py --model models/demo-target \\
        --eagle3-head models/demo-target-eagle3 --peagle-head models/demo-target-peagle
    .venv/bin/python lab/measure/sampling.py --temperatures 0,0.7,1.0 --concurrency 1,16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from peagle.bench.runner import Bench
from peagle.data.benchmarks import load_dataset
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
from peagle.paths import portable_path
from peagle.sampling import SamplingParams

NAMES = {"baseline": "plain decoding", "eagle3": "EAGLE-3", "peagle": "P-EAGLE"}


def cells(temperatures, methods):
    """(T, method, draft_sampling) in run order; T=0 runs each head once (the modes coincide)."""
    out = []
    for t in temperatures:
        out.append((t, "baseline", "-"))
        for m in methods:
            out += [(t, m, "argmax")] + ([(t, m, "sample")] if t > 0 else [])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD)
    ap.add_argument("--peagle-head", default=DEFAULT_PEAGLE_HEAD)
    ap.add_argument("--methods", default="eagle3,peagle")
    ap.add_argument("--k", type=int, default=3, help="speculative tokens per step (both heads)")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--dataset", default="mtbench", help="prompts (chat: mtbench; code: humaneval)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: max(4, c) per concurrency c")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    temps = [float(x) for x in a.temperatures.split(",")]
    cs = [int(x) for x in a.concurrency.split(",")]
    methods = [m for m in a.methods.split(",") if m]
    bench = Bench(a.model, {"eagle3": a.eagle3_head, "peagle": a.peagle_head}, seed=a.seed, max_batch=max(cs))
    command = "lab/measure/sampling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# {command}\n# target {portable_path(a.model)}, K={a.k}, {a.output_len} tokens per prompt (EOS ignored), "
          f"top_p {a.top_p}, top_k {a.top_k}, median of {a.repeats}, torch threads {torch.get_num_threads()}")
    results = []
    for c in cs:
        n = a.num_prompts or max(4, c)
        ids = [bench.encode(p) for p in load_dataset(a.dataset, n, seed=a.seed)][:n]
        mlen = max(map(len, ids)) + a.output_len + 8
        todo = cells(temps, methods)
        runs = {x: [] for x in todo}
        bench.draft_sampling = "argmax"
        bench.run("baseline", 0, 1, [ids[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True), 64)   # warm-up
        for _ in range(a.repeats):
            for t, m, mode in todo:
                bench.draft_sampling = "argmax" if mode == "-" else mode
                params = SamplingParams(temperature=t, top_p=a.top_p, top_k=a.top_k, max_tokens=a.output_len,
                                        ignore_eos=True)
                runs[(t, m, mode)].append(bench.run(m, 0 if m == "baseline" else a.k, c, ids, params, mlen))
        print(f"\n## c={c}, {n} {a.dataset} prompts\n")
        print("| T | method | drafts | tokens/s | ÷ plain | AL | per-position acceptance |")
        print("|---|---|---|---|---|---|---|")
        plain = {}
        for t, m, mode in todo:
            rs = runs[(t, m, mode)]
            wall = statistics.median(r["wall_s"] for r in rs)
            tok_s = rs[0]["output_tokens"] / wall
            if m == "baseline":
                plain[t] = tok_s
            met = rs[0]["metrics"]
            al = statistics.mean(r["metrics"]["mean_acceptance_length"] for r in rs) if m != "baseline" else None
            pos = ([round(statistics.mean(r["metrics"]["acceptance_rate_per_pos"][i] for r in rs), 2)
                    for i in range(len(met["acceptance_rate_per_pos"]))] if m != "baseline" else [])
            results.append({"c": c, "temperature": t, "method": m, "draft_sampling": mode, "tok_s": tok_s,
                            "speedup": tok_s / plain[t], "acceptance_length": al, "acceptance_per_pos": pos,
                            "output_tokens": rs[0]["output_tokens"], "walls_s": [r["wall_s"] for r in rs]})
            print(f"| {t:g} | {NAMES[m]} | {mode} | {tok_s:.1f} | {tok_s / plain[t]:.2f}× | "
                  f"{'' if al is None else f'{al:.2f}'} | {', '.join(f'{x:.2f}' for x in pos)} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": command, "model": portable_path(a.model), "k": a.k, "output_len": a.output_len,
                       "top_p": a.top_p, "top_k": a.top_k, "repeats": a.repeats, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
