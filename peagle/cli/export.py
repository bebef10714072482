"""`peagle export HEAD OUT`: a peagle head in vLLM's flat EAGLE-3 layout or the speculators layout, validated
first (what is written: peagle/heads/export.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import PeagleError
from ..heads.config import is_parallel_head
from ..heads.export import FORMATS, export_head
from ..heads.format import HeadValidationError
from ..heads.io import NotAHeadError
from ..spec_config import MAX_K, speculative_config
from . import int_arg


def _k(x: str) -> int:
    """-k: an integer in 1..MAX_K (what peagle and vLLM's spec config take), refused before any work."""
    return int_arg(x, 1, MAX_K)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="export a head for vLLM (flat EAGLE-3 layout or speculators layout), validated first",
        description="Validate a peagle head and write it in vLLM's flat EAGLE-3 layout (--format vllm, loads on "
                    "vLLM >= 0.16) or the speculators layout (--format speculators, vLLM >= 0.22). Nothing is "
                    "written if the head is invalid (exit status 2). An existing OUT is refused unless --force.")
    p.add_argument("head", help="head directory (peagle native layout)")
    p.add_argument("out", help="output directory (new or empty; --force replaces an existing head's)")
    p.add_argument("--format", choices=FORMATS, default="vllm")
    p.add_argument("--target", default=None, help="target model dir: validates vocab, aux ids, hidden size and "
                                                  "context against it; names the verifier (speculators)")
    p.add_argument("-k", "--num-speculative-tokens", type=_k, default=None, dest="k",
                   help=f"K to serve with, 1..{MAX_K} (speculators proposal_methods; default: the head's trained "
                        "depth, else 3)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing head in OUT (never the source head, a model's or other files)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    notes: list[str] = []
    try:
        cfg = export_head(args.head, args.out, format=args.format, target_dir=getattr(args, "target", None),
                          num_speculative_tokens=getattr(args, "k", None), notes=notes,
                          overwrite=getattr(args, "force", False))
    except HeadValidationError as e:        # exit status 2 (docs/vllm-parity.md): an invalid head, every problem
        print(f"peagle: error: {e}\nnothing written to {args.out}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, NotADirectoryError, NotAHeadError) as e:
        raise PeagleError(f"{e}; nothing written") from None
    for n in notes:
        print(f"note: {n}")
    if args.format == "vllm":
        parallel = is_parallel_head(cfg)
        k = cfg.get("peagle", {}).get("num_speculative_tokens", 3)
        spec = speculative_config(Path(args.out).resolve(), k, parallel)
        print(f"wrote {args.out} (vLLM flat EAGLE-3 layout). Serve with:\n"
              f"  vllm serve {getattr(args, 'target', None) or 'TARGET'} --speculative-config '{json.dumps(spec)}'")
    else:
        print(f"wrote {args.out} (speculators layout, {cfg['speculators_model_type']}, K="
              f"{cfg['speculators_config']['proposal_methods'][0]['speculative_tokens']}). Serve with:\n"
              f"  vllm serve {Path(args.out).resolve()}   (vLLM >= 0.22)")
    return 0
