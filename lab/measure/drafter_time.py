"""Drafter time per step vs K: autoregressive EAGLE-3 (K drafter passes) vs P-EAGLE (one pass).

Times `proposer.propose()` alone -- what the engine's drafting phase costs per step -- on a synthetic but
realistic step: a drafter KV cache already holding --context positions per row and --new rows (accepted
tokens + the new token) to add, like a step after accepting new-1 drafts. Methods and K values are
interleaved and the median of --repeats is reported; the target's verification pass over K+1 tokens is
timed the same way for scale. Uses the shipped heads when present, else random heads of the same shape.

    .venv/bin/python lab/measure/drafter_time.py                       # demo target + shipped heads, batch 1
    .venv/bin/python lab/measure/drafter_time.py --batch 8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.demo_target.model import target_or_random
from lab.demo_target.tokenizer import MASK_ID
from peagle.drafters.base import DraftBatch
from peagle.drafters.eagle3 import Eagle3Proposer
from peagle.drafters.peagle import PEagleProposer
from peagle.engine import cache_len
from peagle.heads.init import head_or_random
from peagle.heads.model import DrafterHead
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
from peagle.models.llama import Transformer


def make_step(head, B, ctx, new, gen):
    V, T3 = head.cfg["vocab_size"], 3 * head.cfg["target_hidden_size"]
    pre = DraftBatch(torch.randint(6, V, (B, ctx), generator=gen), torch.randn(B, ctx, T3, generator=gen),
                     torch.zeros(B, dtype=torch.long), torch.full((B,), ctx))
    step = DraftBatch(torch.randint(6, V, (B, new), generator=gen), torch.randn(B, new, T3, generator=gen),
                      torch.full((B,), ctx), torch.full((B,), new))
    return pre, step


def time_call(fn, inner):
    fn()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner * 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD)
    ap.add_argument("--peagle-head", default=DEFAULT_PEAGLE_HEAD)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8,9,10")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="positions already in the drafter cache per row")
    ap.add_argument("--new", type=int, default=3, help="rows added per step (accepted drafts + 1)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed sample")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-verify", action="store_true", help="skip timing the target's verification pass")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    print("Regenerate: `.venv/bin/python " + " ".join([os.path.relpath(__file__)] + list(
        sys.argv[1:] if argv is None else argv)) + "`")
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    ks = [int(x) for x in a.ks.split(",")]
    scratch = os.path.join(tempfile.gettempdir(), "peagle-drafter-time")
    model = target_or_random(a.model, scratch)
    target = Transformer.from_pretrained(model)
    # a random demo-shaped target has no tokenizer files: its mask token is the demo tokenizer's reserved id
    mask = None if model == a.model else MASK_ID
    heads = {"eagle3": head_or_random(a.eagle3_head, model, scratch, parallel=False),
             "peagle": head_or_random(a.peagle_head, model, scratch, parallel=True, mask_token=mask)}
    loaded = {m: DrafterHead.from_pretrained(d, target.cfg, parallel=(m == "peagle"), target_embed=target.embed)
              for m, d in heads.items()}
    gen = torch.Generator().manual_seed(0)
    props, steps = {}, {}
    for m, h in loaded.items():
        pre, step = make_step(h, a.batch, a.context, a.new, gen)
        for k in ks:
            p = (PEagleProposer if m == "peagle" else Eagle3Proposer)(h, k, cache_len(a.context + a.new, k), a.batch)
            p.prefill(pre)
            props[(m, k)], steps[m] = p, step
    verify = {}
    if not a.no_verify:
        cache = target.new_cache(a.batch, a.context + 16)
        ids = torch.randint(6, target.cfg.vocab_size, (a.batch, a.context), generator=gen)
        target.forward(ids, cache, 0, torch.zeros(a.batch, dtype=torch.long))
        aux = loaded["peagle"].aux_ids
        one = torch.randint(6, target.cfg.vocab_size, (a.batch, 1), generator=gen)
        verify[0] = lambda: target.forward(one, cache, 0, torch.full((a.batch,), a.context))   # plain decode step
        for k in ks:
            blk = torch.randint(6, target.cfg.vocab_size, (a.batch, k + 1), generator=gen)
            verify[k] = lambda blk=blk: target.forward(blk, cache, 0, torch.full((a.batch,), a.context), aux)
    samples = {key: [] for key in props}
    vsamples = {k: [] for k in verify}
    for r in range(a.repeats):                     # interleaved: every (method, K) once per repeat
        order = list(props)
        if r % 2:
            order.reverse()
        for key in order:
            p, st = props[key], steps[key[0]]
            samples[key].append(time_call(lambda: p.propose(st), a.inner))
        for k, fn in verify.items():
            vsamples[k].append(time_call(fn, a.inner))
    med = {key: statistics.median(v) for key, v in samples.items()}
    vmed = {k: statistics.median(v) for k, v in vsamples.items()}
    tl = target.cfg.num_hidden_layers
    print(f"\nDrafter time per step (ms, median of {a.repeats}x{a.inner}), batch {a.batch}, context {a.context}, "
          f"{a.new} new rows/step; target {os.path.basename(model.rstrip('/'))} ({tl} layers, width "
          f"{target.cfg.hidden_size}); heads: " + ", ".join(
              f"{m} {os.path.basename(d.rstrip('/'))} ({loaded[m].cfg['num_hidden_layers']} layer(s))"
              for m, d in heads.items()) + f"; {torch.get_num_threads()} threads\n")
    hdr = "| K | EAGLE-3 ms | P-EAGLE ms | EAGLE-3 ÷ P-EAGLE |" + (" target verify (K+1 tokens) ms |" if vmed else "")
    print(hdr)
    print("|---|---|---|---|" + ("---|" if vmed else ""))
    if vmed:
        print(f"| 0 (plain decode step, 1 token) | – | – | – | {vmed[0]:.2f} |")
    for k in ks:
        e, p = med[("eagle3", k)], med[("peagle", k)]
        print(f"| {k} | {e:.2f} | {p:.2f} | {e / p:.2f}× |" + (f" {vmed[k]:.2f} |" if vmed else ""))
    e1, p1 = med[("eagle3", ks[0])], med[("peagle", ks[0])]
    ek, pk = med[("eagle3", ks[-1])], med[("peagle", ks[-1])]
    print(f"\nFrom K={ks[0]} to K={ks[-1]}: EAGLE-3 x{ek / e1:.2f}, P-EAGLE x{pk / p1:.2f} "
          f"(EAGLE-3 slope {(ek - e1) / max(ks[-1] - ks[0], 1):.2f} ms per extra draft token, "
          f"P-EAGLE {(pk - p1) / max(ks[-1] - ks[0], 1):.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "model": model, "heads": heads, "threads": torch.get_num_threads(),
                       "samples_ms": {f"{m}/{k}": v for (m, k), v in samples.items()},
                       "median_ms": {f"{m}/{k}": v for (m, k), v in med.items()},
                       "verify_median_ms": vmed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
