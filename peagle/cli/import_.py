"""`peagle import SRC OUT`: a published EAGLE-3 / P-EAGLE head (vLLM flat or speculators layout) into peagle's
layout, validated (the conversion: peagle/heads/importer.py)."""
from __future__ import annotations

import argparse
import sys

from ..errors import PeagleError
from ..heads.format import HeadValidationError
from ..heads.importer import import_head
from ..heads.io import NotAHeadError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import", help="import a published EAGLE-3 / P-EAGLE head (vLLM flat or speculators layout) into peagle's layout",
        description="Convert a head in vLLM's flat EAGLE-3 layout (incl. midlayer.* names, model. prefixes) or the "
                    "speculators layout into peagle's native layout, and validate it (against the target if given). "
                    "Nothing is written if it is invalid (exit status 2). An existing OUT is refused unless --force.")
    p.add_argument("src", help="head directory (config.json + *.safetensors)")
    p.add_argument("out", help="output directory (native layout; new or empty, --force replaces an existing head's)")
    p.add_argument("--target", default=None, help="target model dir: checks vocab/aux ids/context, supplies "
                                                  "embed_tokens (and lm_head) if the head does not ship them")
    p.add_argument("--force", action="store_true",
                   help="replace an existing head in OUT (never the source head, a model's or other files)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    notes: list[str] = []
    try:
        cfg, ts = import_head(args.src, args.out, target_dir=getattr(args, "target", None), notes=notes,
                              overwrite=getattr(args, "force", False))
    except HeadValidationError as e:        # exit status 2, as export's: an invalid head, every problem listed
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        print(f"peagle: error: {e}\nnothing written to {args.out}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, NotADirectoryError, NotAHeadError) as e:
        raise PeagleError(f"{e}; nothing written") from None
    for n in notes:
        print(f"note: {n}")
    pb = cfg.get("peagle", {})
    print(f"imported {args.src} -> {args.out}: method={pb.get('method')} layers={cfg['num_hidden_layers']} "
          f"H={cfg['hidden_size']} T={cfg['target_hidden_size']} draft_vocab={cfg['draft_vocab_size']}/"
          f"{cfg['vocab_size']} aux={cfg['eagle_aux_hidden_state_layer_ids']}"
          + (f" mask_token={cfg['ptd_token_id']}" if cfg.get("ptd_token_id") is not None else ""))
    return 0
