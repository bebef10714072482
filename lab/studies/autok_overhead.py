"""What does "auto" cost when it decodes plainly? Engines compared request by request, interleaved.

A VM's step time drifts by up to ±15 % between identical runs, more than the cost in question, so the engines
are not run one after the other: each group of c requests of each pass runs on every engine in turn (same
prompts, greedy), and the ratios are of total tokens ÷ total seconds over all passes. Engines:
* plain: no drafter;
* fixed0: the drafter attached with K = 0 at every step (the aux-state recording and drafter-row bookkeeping
  of a K = 0 step, no policy);
* static-M-K: head M (eagle3 / peagle) at a static K;
* maxk-M-K: auto's engine for head M (proposer and caches built for the head's largest K) held at K;
* auto-M-S[-G[-P[-E]]]: `"num_speculative_tokens": "auto"` with head M (eagle3 / peagle), AutoK's `settle` = S
  (1: the estimate at every step, the behaviour before settling), if given its margin G (default
  peagle.autok.config.MARGIN), probe_tol P ("off": no probing, the default; 0.1: PROBE_TOL) and keep E
  (default KEEP);
  an empty field keeps the default;
  also the policy's own seconds per step (choose + observe).

    .venv/bin/python lab/studies/autok_overhead.py --passes 4
    .venv/bin/python lab/studies/autok_overhead.py --passes 3 --concurrency 8 --engines plain,fixed0,auto-eagle3-16,auto-peagle-16
    .venv/bin/python lab/studies/autok_overhead.py --model models/smollm2-135m-instruct --num-prompts 4 --passes 3
    .venv/bin/python lab/studies/autok_overhead.py --engines plain,auto-eagle3-16,auto-eagle3-16-0.05   # margins
    .venv/bin/python lab/studies/autok_overhead.py --engines plain,auto-peagle-16,auto-peagle-16--0.1  # probing
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from peagle.bench.runner import Bench
from peagle.data.benchmarks import load_dataset
from peagle.kpolicy import FixedK
from peagle.llm import DEMO_TARGET
from peagle.sampling import SamplingParams


def build(bench: Bench, kind: str, c: int):
    """(engine, policy seconds counter [seconds, steps]) for one engine kind."""
    if kind == "plain":
        return bench.engine("baseline", 0, c, 4096), None
    if kind == "fixed0":
        eng = bench.engine("eagle3", 1, c, 4096)
        eng.k_policy = FixedK(0)
        return eng, None
    if kind.startswith("maxk-"):              # auto's engine (built for the head's largest K), FixedK(K)
        _, method, k = kind.split("-")
        eng = bench.engine(method, "auto", c, 4096)
        eng.k_policy = FixedK(int(k))
        return eng, None
    if kind.startswith("static-"):
        _, method, k = kind.split("-")
        return bench.engine(method, int(k), c, 4096), None
    _, method, settle, *rest = kind.split("-")
    eng = bench.engine(method, "auto", c, 4096)
    pol, spent = eng.k_policy, [0.0, 0]
    pol.settle = int(settle)
    if rest and rest[0]:
        pol.margin = float(rest[0])
    if len(rest) > 1 and rest[1]:
        pol.probe_tol = None if rest[1] == "off" else float(rest[1])
    if len(rest) > 2:
        pol.keep = float(rest[2])
    choose, observe = pol.choose, pol.observe

    def timed_choose(rows):
        t = time.perf_counter()
        k = choose(rows)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return k

    def timed_observe(*args, **kwargs):
        t = time.perf_counter()
        observe(*args, **kwargs)
        spent[0] += time.perf_counter() - t
    pol.choose, pol.observe = timed_choose, timed_observe
    return eng, spent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEMO_TARGET)
    ap.add_argument("--eagle3-head", default=None, help="default: the model's -eagle3 directory")
    ap.add_argument("--peagle-head", default=None, help="default: the model's -peagle directory")
    ap.add_argument("--engines", default="plain,fixed0,auto-eagle3-16,auto-eagle3-1,auto-peagle-16,auto-peagle-1")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1, help="requests run together (a group per engine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none", help="the target's (peagle generate's choices; auto: what "
                    "a user gets by default)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = a.model.rstrip("/")
    bench = Bench(model, {"eagle3": a.eagle3_head or model + "-eagle3", "peagle": a.peagle_head or model + "-peagle"},
                  quantization=a.quantization)
    prompts = [bench.encode(p) for p in load_dataset(a.dataset, a.num_prompts)]
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0)
    kinds = a.engines.split(",")
    c = a.concurrency
    engines = {k: build(bench, k, c) for k in kinds}
    secs, toks = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0)
    outs: dict = {}
    for p in range(a.passes):
        for g in range(0, len(prompts), c):
            for k in kinds:
                eng = engines[k][0]
                t = time.perf_counter()
                reqs = [eng.add_request(f"p{p}-{i}", prompts[i], params) for i in range(g, min(g + c, len(prompts)))]
                while eng.has_unfinished():
                    eng.step()
                secs[k] += time.perf_counter() - t
                for i, req in enumerate(reqs, g):
                    toks[k] += len(req.output_ids)
                    outs.setdefault((p, i), set()).add(tuple(req.output_ids))
    same = sum(len(v) == 1 for v in outs.values())
    print(f"{os.path.basename(model)} ({bench.quantization}), {a.dataset}, {a.num_prompts} prompts x "
          f"{a.output_len} tokens, c={c}, "
          f"{a.passes} interleaved passes; outputs identical on every engine: {same}/{len(outs)}\n")
    print("| engine | tokens/s | ÷ plain | mean K | policy ms/step | probes (passed), trusted batch sizes |\n"
          "|---|---|---|---|---|---|")
    base = toks[kinds[0]] / secs[kinds[0]]
    for k in kinds:
        eng, spent = engines[k]
        rate = toks[k] / secs[k]
        pol = f"{1e3 * spent[0] / max(spent[1], 1):.3f}" if spent else "-"
        d = eng.k_policy.describe() if spent else {}
        probes = f"{d['probes_probes']} ({d['probes_passed']}), {d['trusted_batch_sizes']}" if "probes_probes" in d else "-"
        print(f"| {k} | {rate:.1f} | {rate / base:.3f} | {eng.metrics.as_dict()['mean_num_speculative_tokens']:.3f} "
              f"| {pol} | {probes} |")
    print(f"\nRegenerate: .venv/bin/python lab/studies/autok_overhead.py {' '.join(argv or sys.argv[1:])}")
    return 0 if same == len(outs) else 1


if __name__ == "__main__":
    sys.exit(main())
