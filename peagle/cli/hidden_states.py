"""`peagle hidden-states`: extract the target's hidden states for drafter training (speculators'
hs_{i}.safetensors format; what is written: peagle/train/hidden_states.py)."""
from __future__ import annotations

import argparse
import sys

import torch

from ..errors import PeagleError
from ..heads.config import default_aux_layer_ids
from ..llm import DEFAULT_MODEL
from ..models.loader import load_target
from ..paths import portable_path
from ..train import hidden_states
from ..train.checks import check_data_dirs, check_data_model, check_out, check_ranges, out_dir
from ..train.data import load_docs, skipped_note
from ..train.hidden_states import default_layer_ids, extract


def add_parser(sub):
    p = sub.add_parser("hidden-states", help="extract the target's hidden states for drafter training "
                       "(speculators' hs_{i}.safetensors format)", description=hidden_states.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target HF directory (default: the default target)")
    p.add_argument("--data", required=True, help="`peagle datagen` output directory (several: comma-separated)")
    p.add_argument("--out", required=True, help="cache directory (rerun to resume)")
    p.add_argument("--layer-ids", default=None,
                   help="comma-separated, the last = num_layers (default: vLLM's aux ids 2,L//2,L-3 and L)")
    p.add_argument("--max-docs", type=int, default=0, help="use at most this many documents (0 = all)")
    p.add_argument("--max-tokens", type=int, default=2048, help="documents are cut to this many tokens")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per target forward")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.set_defaults(func=run)


def run(a):
    check_ranges(a, ("max_tokens", "max_batch_tokens"), ("max_docs", "threads"))   # before anything loads
    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model or DEFAULT_MODEL
    label = None if a.model else f"{portable_path(model)} (the default)"
    try:
        given = [int(x) for x in a.layer_ids.split(",")] if a.layer_ids else None
    except ValueError:
        raise PeagleError(f"--layer-ids is comma-separated layer numbers, got {a.layer_ids!r}") from None
    check_data_dirs(a.data)
    check_out(a.out, model)
    check_data_model(a.data, model, "--model", label)
    check_data_model(a.out, model, "--model", label, "--out")          # a cache being resumed: the same target's
    counts = {}
    docs = [(t[: a.max_tokens], m[: a.max_tokens]) for t, m in load_docs(a.data, a.max_docs or None, counts=counts)]
    note = skipped_note(counts["read"], counts["skipped"])
    if note:
        print(f"hidden-states: {note}", file=sys.stderr, flush=True)
    with out_dir(a.out):                          # a run that fails before writing anything leaves no empty --out
        target = load_target(model)
        L = target.cfg.num_hidden_layers
        if given is not None and not all(0 <= i <= L for i in given):
            raise PeagleError(f"--layer-ids {a.layer_ids}: this target's layers are 0..{L} (L = the final state)")
        ids = given if given is not None else default_layer_ids(L, default_aux_layer_ids(L))
        r = extract(target, docs, a.out, ids, a.max_batch_tokens, model_name=portable_path(model),
                    max_tokens=a.max_tokens)
    print(f"{a.out}: {len(docs)} samples; this run {r['samples']} samples, {r['tokens']} tokens in "
          f"{r['seconds']:.0f} s ({r['tokens'] / max(r['seconds'], 1e-9):.0f} tok/s), "
          f"{r['bytes_per_token'] / 1024:.1f} KiB per token")
    return 0
