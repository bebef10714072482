"""`peagle bench` run: baseline vs EAGLE-3 vs P-EAGLE (and HF transformers peers) -> JSON, Markdown, PNGs
(the flags: peagle/cli/bench.py)."""
from __future__ import annotations

import json
import os
import shlex
import time

from ..errors import PeagleError
from ..heads.init import random_head
from ..paths import missing_hint
from ..paths import portable_path as rel
from ..spec_config import DEFAULT_DRAFT_SAMPLING
from .plots import FILES as PLOT_FILES
from .report import read_notes, write_all
from .sweep import run_sweep

QUICK = dict(num_prompts=4, output_len=64, ks=[3, 7, "auto"], concurrency=[1, 4], peer_prompts=2)
FULL = dict(num_prompts=None, output_len=256, ks=[1, 3, 5, 7, "auto"], concurrency=[1, 2, 4, 8, 16, 32, 64, 128],
            peer_prompts=16)


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
    if getattr(a, "trees", None):
        parts += ["--trees", ",".join(a.trees)]
    if getattr(a, "draft_sampling", DEFAULT_DRAFT_SAMPLING) != DEFAULT_DRAFT_SAMPLING:
        parts += ["--draft-sampling", a.draft_sampling]
    if getattr(a, "auto_k", None) is not None and a.auto_k.as_dict():
        parts += ["--auto-k", json.dumps(a.auto_k.as_dict(), separators=(",", ":"))]
    if a.ignore_eos:
        parts.append("--ignore-eos")
    if not a.fill_concurrency:
        parts.append("--no-fill-concurrency")
    parts += ["--repeats", str(a.repeats), "--ref-every", str(getattr(a, "ref_every", 0)),
              "--humaneval-format", a.humaneval_format, "--mtbench-turns", str(a.mtbench_turns),
              "--max-prompt-len", str(a.max_prompt_len), "--peers", ",".join(a.peers),
              "--peer-prompts", str(a.peer_prompts), "--pld-tokens", str(a.pld_tokens),
              "--device", a.device, "--dtype", a.dtype, "--seed", str(a.seed)]
    parts += ["--quantization", getattr(a, "quantization", None) or "none",
              "--target-backend", getattr(a, "target_backend", None) or "auto"]
    if getattr(a, "kv_cache_dtype", "auto") != "auto":
        parts += ["--kv-cache-dtype", a.kv_cache_dtype]
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
            raise PeagleError(f"{m} head not found at {d}" + (missing_hint(d) or f" (train/ship it, pass --{m}-head "
                              "DIR, or --random-heads to test the harness)"))
        d = os.path.join(a.out, ".random-heads", m)
        random_head(a.model, d, parallel=(m == "peagle"), mask_token=a.mask_token)
        log(f"bench: {m}: using a RANDOM head at {d} (acceptance figures are meaningless)")
        setattr(a, f"{m}_head", d)


def run(a) -> int:
    import torch
    read_notes(a.notes)                        # a bad --notes fails now, not after the sweep
    if a.from_json:
        try:
            with open(a.from_json) as f:
                res = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PeagleError(f"--from-json {a.from_json}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(res, dict) or "runs" not in res:
            raise PeagleError(f"--from-json {a.from_json}: not a peagle bench results.json (no 'runs')")
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
    if getattr(a, "trees", None):
        from .trees_report import write_trees_report
        paths.append(write_trees_report(res, os.path.join(a.out, "trees.md")))
    print(f"bench: done in {time.time() - t0:.0f}s -> " + ", ".join(paths))
    stale = stale_outputs(a.out, paths)
    if stale:                                   # kept (nothing is deleted), but said: they are not this run's
        print(f"bench: note: {', '.join(stale)} in {a.out} {'is' if len(stale) == 1 else 'are'} from an earlier "
              "run (this run wrote no such file)")
    return 0


# every file a bench run may write into --out (report.py, trees_report.py, plots.py)
OUTPUTS = ("results.json", "report.md", "trees.md") + PLOT_FILES


def stale_outputs(out: str, written: list) -> list:
    """bench's own output names present in out that this run did not write (an earlier run's, other options)."""
    done = {os.path.basename(p) for p in written}
    return [n for n in OUTPUTS if n not in done and os.path.isfile(os.path.join(out, n))]
