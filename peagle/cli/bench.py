"""`peagle bench`: baseline vs EAGLE-3 vs P-EAGLE (and HF transformers peers) -> JSON, Markdown, PNGs (the
flags; the run: peagle/bench/command.py)."""
from __future__ import annotations

import argparse
import json

from ..autok.config import AutoKConfig
from ..bench.command import QUICK, run
from ..compile import add_argument
from ..data.benchmarks import DATASETS
from ..device import add_arguments
from ..errors import PeagleError
from ..llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
from ..models.loader import add_backend_argument, add_kv_cache_argument, add_quantization_argument
from ..spec_config import DEFAULT_DRAFT_SAMPLING, DRAFT_SAMPLING, MAX_K
from . import int_arg


def _at_least(lo: int):
    def parse(s):
        return int_arg(s.strip(), lo)
    return parse


def _ints(s):
    """Concurrency levels: a comma list of integers >= 1."""
    out = [int_arg(x.strip(), 1) for x in str(s).split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("a comma list of integers >= 1, got an empty list")
    return out


def _ks(s):
    """K values: integers in 1..32 (the speculative config's range), and "auto" (K chosen per step; a method per
    drafter in the tables)."""
    out = [x.strip() for x in str(s).split(",") if x.strip()]
    bad = [x for x in out if x != "auto" and not (x.lstrip("-").isdigit() and 1 <= int(x) <= MAX_K)]
    if bad or not out:
        raise argparse.ArgumentTypeError(f'K values are integers in 1..{MAX_K} or "auto", got {", ".join(bad) or "none"}')
    return [x if x == "auto" else int(x) for x in out]


PEERS = ("hf", "hf-pld")


def _strs(s):
    return [x.strip() for x in str(s).split(",") if x.strip()]


def _among(known):
    """A comma-separated list of names from `known` (a typo is an error, not a run that skips it)."""
    def parse(s):
        names = _strs(s)
        bad = [x for x in names if x not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad)) or 'empty list'} "
                                             f"(known: {', '.join(known)})")
        return names
    return parse


def _peers(s):
    """HF peers: names from PEERS, or '' for none (a typo is an error: an unknown name ran no peer)."""
    return _among(PEERS)(s) if _strs(s) else []


def _trees(s):
    """Token trees: "4x8,8x16" = eagle_topk x num_draft_tokens (nodes <= 64)."""
    out = []
    for x in _strs(s):
        try:
            topk, nodes = (int(v) for v in x.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a tree is TOPKxNODES (e.g. 4x8), got {x!r}") from None
        if not (1 <= topk <= 64 and 1 <= nodes <= 64):
            raise argparse.ArgumentTypeError(f"tree {x!r}: eagle_topk and num_draft_tokens must be in 1..64")
        out.append(f"{topk}x{nodes}")
    return out


def _auto_k(s: str) -> AutoKConfig:
    try:
        d = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    try:
        return AutoKConfig.from_dict(d)
    except PeagleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark baseline vs EAGLE-3 vs P-EAGLE (offline through the engine, or "
                                     "online through the server)",
                       description="Sweeps datasets x methods x K x concurrency in one run and writes "
                                   "results.json, report.md and PNG plots.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target HF directory (default: the default target)")
    p.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD)
    p.add_argument("--peagle-head", default=DEFAULT_PEAGLE_HEAD)
    p.add_argument("--datasets", type=_among(DATASETS), default=["mtbench", "humaneval", "speed"],
                   help="comma list of mtbench, humaneval, speed")
    p.add_argument("--methods", type=_among(("baseline", "eagle3", "peagle")), default=["baseline", "eagle3", "peagle"])
    p.add_argument("--ks", "--num-speculative-tokens", type=_ks, default=None, dest="ks",
                   help='K values; "auto" = K chosen per step up to the head\'s trained depth (default 1,3,5,7,auto)')
    p.add_argument("--trees", type=_trees, default=None, metavar="TOPKxNODES,...",
                   help='token trees besides the chains: e.g. 4x8,8x16 (eagle_topk x num_draft_tokens) adds a '
                        '"peagle+tree4x8" / "eagle3+tree4x8" run per integer K (the depth bound); offline runs, '
                        'report in OUT/trees.md (peagle/bench/trees_report.py)')
    p.add_argument("--auto-k", type=_auto_k, default=None, metavar="JSON",
                   help='auto K\'s settings for the "auto" runs, as the speculative config\'s "auto_k" takes them, '
                        'e.g. \'{"margin": 0.05, "guard": false}\' (offline runs)')
    p.add_argument("--remeasure", action="store_true",
                   help='measure the step-cost model of K "auto" now instead of using the cached one')
    p.add_argument("--concurrency", type=_ints, default=None, help="default 1,2,4,8,16,32,64,128")
    p.add_argument("--num-prompts", type=_at_least(1), default=None, help="prompts per dataset (default: all; speed: 80)")
    p.add_argument("--output-len", type=_at_least(1), default=None, help="max output tokens (default 256)")
    p.add_argument("--mode", choices=["offline", "online", "both"], default="offline",
                   help="offline: through the engine in this process; online: through `peagle serve` subprocesses "
                        "(one per method/K) with c concurrent streaming openai clients; both")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-sampling", choices=list(DRAFT_SAMPLING), default=DEFAULT_DRAFT_SAMPLING,
                   help="the speculative config's draft_sampling: argmax drafts (vLLM's) or drafts sampled from the "
                   "drafter's distribution at temperature > 0 (see docs/sampling.md; default %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    p.add_argument("--fill-concurrency", action=argparse.BooleanOptionalAction, default=True,
                   help="at concurrency c > prompts, repeat prompts so c requests are in flight (default on)")
    p.add_argument("--repeats", type=_at_least(1), default=1, help="interleaved repeats of every run (median reported)")
    p.add_argument("--ref-every", type=_at_least(0), default=4, metavar="N",
                   help="run the baseline again after every N runs of a repeat (and at its end), so each run is "
                        "compared with baselines close in time: ratios cancel the machine's drift (default 4; "
                        "0: once per repeat)")
    p.add_argument("--humaneval-format", choices=["raw", "chat"], default="raw")
    p.add_argument("--mtbench-turns", type=int, choices=[1, 2], default=1)
    p.add_argument("--max-prompt-len", type=_at_least(1), default=1024, help="skip longer prompts (tokens; default 1024)")
    p.add_argument("--peers", type=_peers, default=list(PEERS),
                   help="HF transformers peers at c=1: hf (generate), hf-pld (prompt lookup); '' for none")
    p.add_argument("--peer-prompts", type=_at_least(1), default=None, help="prompts per dataset for the HF peers (16)")
    p.add_argument("--pld-tokens", type=_at_least(1), default=10, help="prompt_lookup_num_tokens for hf-pld")
    add_arguments(p)
    add_argument(p)
    add_backend_argument(p)
    add_quantization_argument(p)
    add_kv_cache_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_at_least(1), default=None, help="torch threads (default: all cores)")
    p.add_argument("--random-heads", action="store_true",
                   help="use random heads of the target's shape when a head directory is missing (harness test)")
    p.add_argument("--mask-token", type=_at_least(0), default=None,
                   help="mask token id of a random P-EAGLE head (default: the target tokenizer's <|mask|>)")
    p.add_argument("--quick", action="store_true",
                   help="sanity run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--out", default="bench-out", help="output directory (results.json, report.md, *.png)")
    p.add_argument("--from-json", default=None, help="only re-render report and plots from a results.json")
    p.add_argument("--notes", default=None, help="a Markdown file inserted into the report after the goals "
                                                 "(analysis written after the run)")
    p.set_defaults(func=run)
