"""`peagle bench`: baseline vs EAGLE-3 vs P-EAGLE (and HF transformers peers) -> JSON, Markdown, PNGs."""
from __future__ import annotations

import json
import os
import shlex
import time

from ..compile import add_argument
from ..device import add_arguments
from ..errors import PeagleError
from ..llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
from ..models.loader import add_backend_argument
from ..paths import portable_path as rel
from .randheads import random_head
from .report import write_all
from .sweep import run_sweep

QUICK = dict(num_prompts=4, output_len=64, ks=[3, 7, "auto"], concurrency=[1, 4], peer_prompts=2)
FULL = dict(num_prompts=None, output_len=256, ks=[1, 3, 5, 7, "auto"], concurrency=[1, 2, 4, 8, 16, 32, 64, 128],
            peer_prompts=16)


def _ints(s):
    return [int(x) for x in str(s).split(",") if x.strip()]


def _ks(s):
    """K values: integers, and "auto" (K chosen per step; a method per drafter in the tables)."""
    return [x.strip() if x.strip() == "auto" else int(x) for x in str(s).split(",") if x.strip()]


def _strs(s):
    return [x.strip() for x in str(s).split(",") if x.strip()]


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark baseline vs EAGLE-3 vs P-EAGLE (offline through the engine, or "
                                     "online through the server)",
                       description="Sweeps datasets x methods x K x concurrency in one run and writes "
                                   "results.json, report.md and PNG plots.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target HF directory (default: the demo target)")
    p.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD)
    p.add_argument("--peagle-head", default=DEFAULT_PEAGLE_HEAD)
    p.add_argument("--datasets", type=_strs, default=["mtbench", "humaneval", "speed"],
                   help="comma list of mtbench, humaneval, speed")
    p.add_argument("--methods", type=_strs, default=["baseline", "eagle3", "peagle"])
    p.add_argument("--ks", "--num-speculative-tokens", type=_ks, default=None, dest="ks",
                   help='K values; "auto" = K chosen per step up to the head\'s trained depth (default 1,3,5,7,auto)')
    p.add_argument("--remeasure", action="store_true",
                   help='measure the step-cost model of K "auto" now instead of using the cached one')
    p.add_argument("--concurrency", type=_ints, default=None, help="default 1,2,4,8,16,32,64,128")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default: all; speed: 80)")
    p.add_argument("--output-len", type=int, default=None, help="max output tokens (default 256)")
    p.add_argument("--mode", choices=["offline", "online", "both"], default="offline",
                   help="offline: through the engine in this process; online: through `peagle serve` subprocesses "
                        "(one per method/K) with c concurrent streaming openai clients; both")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    p.add_argument("--fill-concurrency", action=argparse_bool(), default=True,
                   help="at concurrency c > prompts, repeat prompts so c requests are in flight (default on)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats of every run (median reported)")
    p.add_argument("--humaneval-format", choices=["raw", "chat"], default="raw")
    p.add_argument("--mtbench-turns", type=int, choices=[1, 2], default=1)
    p.add_argument("--max-prompt-len", type=int, default=1024, help="skip longer prompts (tokens)")
    p.add_argument("--peers", type=_strs, default=["hf", "hf-pld"],
                   help="HF transformers peers at c=1: hf (generate), hf-pld (prompt lookup); '' for none")
    p.add_argument("--peer-prompts", type=int, default=None, help="prompts per dataset for the HF peers (16)")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-pld")
    add_arguments(p)
    add_argument(p)
    add_backend_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--random-heads", action="store_true",
                   help="use random heads of the target's shape when a head directory is missing (harness test)")
    p.add_argument("--mask-token", type=int, default=None,
                   help="mask token id of a random P-EAGLE head (default: the target tokenizer's <|mask|>)")
    p.add_argument("--quick", action="store_true",
                   help="sanity run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--out", default="bench-out", help="output directory (results.json, report.md, *.png)")
    p.add_argument("--from-json", default=None, help="only re-render report and plots from a results.json")
    p.add_argument("--notes", default=None, help="a Markdown file inserted into the report after the goals "
                                                 "(analysis written after the run)")
    p.set_defaults(func=run)


def argparse_bool():
    import argparse
    return argparse.BooleanOptionalAction


def apply_defaults(a):
    """Options left unset take the --quick values under --quick, else the full sweep's."""
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def canonical_command(a) -> str:
    """The run's settings as one explicit command line (regenerates the same sweep whatever the defaults)."""
    parts = ["peagle", "bench", "--model", rel(a.model)]
    for m in ("eagle3", "peagle"):
        if m in a.methods:
            parts += [f"--{m}-head", rel(getattr(a, f"{m}_head"))]
    parts += ["--datasets", ",".join(a.datasets), "--methods", ",".join(a.methods),
              "--ks", ",".join(map(str, a.ks)), "--concurrency", ",".join(map(str, a.concurrency))]
    if a.num_prompts:
        parts += ["--num-prompts", str(a.num_prompts)]
    if a.mode != "offline":
        parts += ["--mode", a.mode]
    parts += ["--output-len", str(a.output_len), "--temperature", str(a.temperature)]
    if a.ignore_eos:
        parts.append("--ignore-eos")
    if not a.fill_concurrency:
        parts.append("--no-fill-concurrency")
    parts += ["--repeats", str(a.repeats), "--humaneval-format", a.humaneval_format, "--mtbench-turns",
              str(a.mtbench_turns), "--max-prompt-len", str(a.max_prompt_len), "--peers", ",".join(a.peers),
              "--peer-prompts", str(a.peer_prompts), "--pld-tokens", str(a.pld_tokens), "--device", a.device, "--dtype", a.dtype,
              "--seed", str(a.seed)]
    if a.threads:
        parts += ["--threads", str(a.threads)]
    if a.compile:
        parts.append("--compile")
    if a.remeasure:
        parts.append("--remeasure")
    if a.random_heads:
        parts.append("--random-heads")
        if a.mask_token is not None:
            parts += ["--mask-token", str(a.mask_token)]
    if a.notes:
        parts += ["--notes", rel(a.notes)]
    parts += ["--out", rel(a.out)]
    return " ".join(shlex.quote(x) for x in parts)


def ensure_heads(a, log=print):
    """Missing head dirs: error, or (with --random-heads) random heads of the target's shape."""
    for m in ("eagle3", "peagle"):
        if m not in a.methods:
            continue
        d = getattr(a, f"{m}_head")
        if d and os.path.isfile(os.path.join(d, "config.json")):
            continue
        if not a.random_heads:
            raise PeagleError(f"{m} head not found at {d} (train/ship it, pass --{m}-head DIR, "
                              f"or --random-heads to test the harness)")
        d = os.path.join(a.out, ".random-heads", m)
        random_head(a.model, d, parallel=(m == "peagle"), mask_token=a.mask_token)
        log(f"bench: {m}: using a RANDOM head at {d} (acceptance figures are meaningless)")
        setattr(a, f"{m}_head", d)


def run(a) -> int:
    import torch
    if a.from_json:
        with open(a.from_json) as f:
            res = json.load(f)
        os.makedirs(a.out, exist_ok=True)
        write_all(res, a.out, a.notes)
        print(f"bench: report re-rendered in {a.out}")
        return 0
    apply_defaults(a)
    a.peers = [x for x in a.peers if x]
    a.command = canonical_command(a)
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"bench: warning: load average {load:.1f} on {os.cpu_count()} cores: other processes compete for the "
              "CPU, timings will be noisy" + (f" ({torch.get_num_threads()} torch threads may thrash; try --threads 1)"
                                                if torch.get_num_threads() > 1 else ""))
    os.makedirs(a.out, exist_ok=True)
    ensure_heads(a)
    t0 = time.time()
    res = run_sweep(a, on_dataset=lambda r: write_all(dict(r, partial=True), a.out))
    paths = write_all(res, a.out, a.notes)
    print(f"bench: done in {time.time() - t0:.0f}s -> " + ", ".join(paths))
    return 0
