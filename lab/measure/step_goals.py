"""Issue 14's step goals side by side, in one run on one device.

1. Host time outside the forward passes: plain, EAGLE-3 and P-EAGLE at c=1 (one request at a time, through the
   engine): wall time minus the target's and drafter's forwards (each timed alone, synchronised on a GPU), in
   ms per engine step and as a share of the step. Goal: <= 5 %.
2. P-EAGLE at c=1: ideal speedup = AL x t_plain / (t_draft + t_verify), with t_plain the plain run's target
   forward per step and t_draft, t_verify P-EAGLE's drafter and verification forwards per step; achieved =
   P-EAGLE tok/s / plain tok/s (prefill included). Goal: achieved >= 0.85 x ideal.
3. Plain decoding vs transformers `generate` on the same weights, greedy, EOS ignored, batch 1 and batch 8
   (lab/measure/plain_decode.py's measurement). Goal: >= 2x.
Runs are interleaved over --repeats and the median is reported; the demo target and shipped heads are used
when present, else random ones of their shape (acceptance then meaningless: parts 1-2 still hold).

    .venv/bin/python lab/measure/step_goals.py                                  # CPU, all cores
    .venv/bin/python lab/measure/step_goals.py --device cuda --json out.json    # GPU (bfloat16)
    .venv/bin/python lab/measure/step_goals.py --prompts 1 --max-tokens 8 --repeats 1 --skip-hf   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plain_decode

from lab.demo_target.model import target_or_random
from peagle import LLM, SamplingParams
from peagle.bench.runner import Bench
from peagle.data.benchmarks import load_dataset
from peagle.heads.init import head_or_random
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
from peagle.paths import portable_path, portable_settings

METHODS = ("baseline", "eagle3", "peagle")


def step_row(r: dict) -> dict:
    """Per-step figures of one Bench.run result."""
    t = r["timing"]
    steps = max(t["n_steps"], 1)
    return {"tok_s": r["output_tok_s"], "al": r["metrics"]["mean_acceptance_length"],
            "step_ms": 1000 * r["wall_s"] / steps, "outside_ms": 1000 * t["other_s"] / steps,
            "outside_pct": 100 * t["other_s"] / r["wall_s"], "draft_ms": t["draft_ms_per_step"],
            "verify_ms": t["verify_ms_per_step"], "steps": t["n_steps"]}


def median_rows(rows: list) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD)
    ap.add_argument("--peagle-head", default=DEFAULT_PEAGLE_HEAD)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per c=1 run (one after another)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-prompts-b1", type=int, default=4)
    ap.add_argument("--skip-hf", action="store_true", help="skip part 3 (plain vs transformers)")
    a = plain_decode.parse(ap, argv, __file__)
    scratch = os.path.join(tempfile.gettempdir(), "peagle-step-goals")
    model = target_or_random(a.model, scratch)
    heads = {"eagle3": head_or_random(a.eagle3_head, model, scratch, parallel=False),
             "peagle": head_or_random(a.peagle_head, model, scratch, parallel=True)}
    bench = Bench(model, heads, a.dtype, 0, 1, device=a.device)
    prompts = [ids[-a.max_prompt_len:] for ids in map(bench.encode, load_dataset(a.dataset, a.prompts))]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    mlen = max(map(len, prompts)) + a.max_tokens + 8
    ks = {"baseline": 0, "eagle3": a.k, "peagle": a.k}
    for m in METHODS:                                     # warm-up
        bench.run(m, ks[m], 1, prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), mlen)
    runs = {m: [] for m in METHODS}
    for rep in range(a.repeats):
        for m in (METHODS if rep % 2 == 0 else METHODS[::-1]):
            r = bench.run(m, ks[m], 1, prompts, sp, mlen)
            runs[m].append(step_row(r))
    med = {m: median_rows(rows) for m, rows in runs.items()}
    dev = f"{bench.device} {str(bench.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads"
    print(f"\n## 1. Outside the forwards at c=1 ({a.dataset}, {len(prompts)} prompts x {a.max_tokens} tokens, K={a.k}, "
          f"median of {a.repeats}; {dev})\n")
    print("| method | tok/s | AL | engine ms/step (prefill incl.) | target fwd ms/step | drafter fwd ms/step | outside ms/step | "
          "outside % of step (goal <= 5) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in METHODS:
        x = med[m]
        print(f"| {m} | {x['tok_s']:.1f} | {x['al']:.2f} | {x['step_ms']:.2f} | {x['verify_ms']:.2f} | "
              f"{x['draft_ms']:.2f} | {x['outside_ms']:.2f} | {x['outside_pct']:.1f} |")
    b, p = med["baseline"], med["peagle"]
    ideal = p["al"] * b["verify_ms"] / (p["draft_ms"] + p["verify_ms"])
    achieved = p["tok_s"] / b["tok_s"]
    print(f"\n## 2. P-EAGLE's share of its ideal speedup at c=1\n\nideal = AL x t_plain / (t_draft + t_verify) = "
          f"{p['al']:.2f} x {b['verify_ms']:.2f} / ({p['draft_ms']:.2f} + {p['verify_ms']:.2f}) = {ideal:.2f}x; "
          f"achieved {achieved:.2f}x; share {achieved / ideal:.2f} (goal >= 0.85)")
    out = {"settings": portable_settings(vars(a), ("model", "eagle3_head", "peagle_head", "json")),
           "model": portable_path(model), "heads": {m: portable_path(h) for m, h in heads.items()},
           "device": str(bench.device), "dtype": str(bench.dtype), "threads": torch.get_num_threads(),
           "runs": runs, "median": med,
           "peagle_ideal_speedup": ideal, "peagle_achieved_speedup": achieved, "peagle_share_of_ideal": achieved / ideal}
    if not a.skip_hf:
        llm = LLM(model, max_num_seqs=8, device=a.device, dtype=a.dtype, quantization="none")   # as HF runs it
        hf = plain_decode.HF(model, llm.device, llm.dtype)
        ps = plain_decode.prompts(llm, max(8, a.hf_prompts_b1), a.max_prompt_len)
        tps, same = plain_decode.measure(llm, hf, ps, [1, 8], a.hf_prompts_b1, a.max_tokens, a.repeats)
        hmed = {k: statistics.median(v) for k, v in tps.items()}
        print(f"\n## 3. Plain decoding vs transformers generate (greedy, {a.max_tokens} tokens, median of {a.repeats})\n")
        print("| batch | peagle tok/s | transformers tok/s | ratio (goal >= 2) | same greedy tokens |")
        print("|---|---|---|---|---|")
        for bsz in (1, 8):
            n = a.hf_prompts_b1 if bsz == 1 else 8
            print(f"| {bsz} | {hmed[('peagle', bsz)]:.1f} | {hmed[('hf', bsz)]:.1f} | "
                  f"{hmed[('peagle', bsz)] / hmed[('hf', bsz)]:.2f}x | {same[bsz]}/{n} |")
        out["plain_vs_hf"] = {f"{e}/b{bsz}": v for (e, bsz), v in hmed.items()}
        out["plain_vs_hf_same"] = same
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
