"""`peagle import SRC OUT`: a published EAGLE-3 / P-EAGLE head (vLLM flat or speculators layout) into peagle's
layout, validated (the conversion: peagle/heads/importer.py)."""
from __future__ import annotations

import argparse
import sys

from ..errors import PeagleError
from ..heads.format import HeadValidationError
from ..heads.importer import import_head


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import", help="import a published EAGLE-3 / P-EAGLE head (vLLM flat or speculators layout) into peagle's layout",
        description="Convert a head in vLLM's flat EAGLE-3 layout (incl. midlayer.* names, model. prefixes) or the "
                    "speculators layout into peagle's native layout, and validate it (against the target if given).")
    p.add_argument("src", help="head directory (config.json + *.safetensors)")
    p.add_argument("out", help="output directory (native layout)")
    p.add_argument("--target", default=None, help="target model dir: checks vocab/aux ids/context, supplies "
                                                  "embed_tokens (and lm_head) if the head does not ship them")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    notes: list[str] = []
    try:
        cfg, ts = import_head(args.src, args.out, target_dir=getattr(args, "target", None), notes=notes)
    except HeadValidationError as e:
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        raise PeagleError(f"{e}; nothing written") from None
    for n in notes:
        print(f"note: {n}")
    pb = cfg.get("peagle", {})
    print(f"imported {args.src} -> {args.out}: method={pb.get('method')} layers={cfg['num_hidden_layers']} "
          f"H={cfg['hidden_size']} T={cfg['target_hidden_size']} draft_vocab={cfg['draft_vocab_size']}/"
          f"{cfg['vocab_size']} aux={cfg['eagle_aux_hidden_state_layer_ids']}"
          + (f" mask_token={cfg['ptd_token_id']}" if cfg.get("ptd_token_id") is not None else ""))
    return 0
