"""Peak RSS of one P-EAGLE training step (K=8 depths, COD r=0.7 / r_min=0.2), flat vs partitioned.

    .venv/bin/python lab/studies/train_memory.py [--lengths 2048,4096,8192,16384] [--budget-gib 10]

Each configuration runs in its own subprocess (so peaks do not mix) on synthetic data: one document of
N tokens (90 % assistant tokens), random target features, a small drafter (hidden 128, 1 layer, 2 heads,
draft vocab 2048, target vocab 8192).  The child reports resource.getrusage(RUSAGE_SELF).ru_maxrss.
Flat runs whose estimated peak exceeds --budget-gib are skipped, and every child runs under an address-
space limit (RLIMIT_AS) so a run that does not fit fails with an allocation error instead of pushing the
machine into the OOM killer (reported as "OOM > limit").  Prints a Markdown table."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H, LAYERS, HEADS, VD, V, K = 128, 1, 2, 2048, 8192, 8


def child(n: int, seg: int, threads: int):
    sys.path.insert(0, ROOT)
    import torch
    torch.set_num_threads(threads)
    from peagle.heads.config import HeadConfig
    from peagle.heads.model import DrafterHead
    from peagle.train.mask import MaskTable
    from peagle.train.peagle_loss import make_elements, row_step
    # a synthetic head (no target, no tokenizer): the mask token id is given explicitly
    cfg = HeadConfig(hidden_size=H, intermediate_size=3 * H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     vocab_size=V, draft_vocab_size=VD, rms_norm_eps=1e-5, max_position_embeddings=n + 64,
                     eagle_aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=4)
    torch.manual_seed(0)
    head = DrafterHead(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (n,), generator=g)
    lmask = torch.ones(n, dtype=torch.bool)
    lmask[: n // 10] = False
    row = {"ids": ids, "doc": torch.zeros(n, dtype=torch.long), "pos": torch.arange(n), "lmask": lmask,
           "aux": torch.randn(n, 3 * H, generator=g),
           "tlogp": torch.log_softmax(torch.randn(n, VD, generator=g), -1),
           "label": torch.where(ids < VD, ids, torch.full_like(ids, -1))}
    table = MaskTable(n)
    el = make_elements(row, K, 0.7, 0.2, torch.Generator().manual_seed(1))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.time()
    st = row_step(head, row, el, table, K, float(el["sup"].sum()), seg)
    dt = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"n": n, "seg": seg, "elements": int(len(el["anchor"])), "peak_gib": peak, "base_gib": base,
                      "time_s": dt, "kl": st["kl"]}))


def flat_estimate_gib(n: int) -> float:
    E = 3.45 * n
    # bool mask + SDPA's additive float copy + gather temporaries, plus per-element activations/logits
    return (E * E * (1 + 4 + 2) + E * (VD * 16 + H * 60)) / 2**30 + 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--segment-len", type=int, default=1024)
    ap.add_argument("--budget-gib", type=float, default=10.0, help="skip flat runs estimated above this")
    ap.add_argument("--limit-gib", type=float, default=14.0, help="address-space limit per child")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.threads)
    rows = []
    for n in [int(x) for x in a.lengths.split(",")]:
        for mode, seg in (("flat", 0), ("partitioned", a.segment_len)):
            if mode == "flat" and flat_estimate_gib(n) > a.budget_gib:
                rows.append((n, mode, "-", f"skipped (est. {flat_estimate_gib(n):.0f} GiB > {a.budget_gib:g} GiB budget)", "-"))
                print(rows[-1], flush=True)
                continue
            lim = int(a.limit_gib * 2**30)

            def pre():
                resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
            r = subprocess.run([sys.executable, __file__, "--child", str(n), str(seg), "--threads", str(a.threads)],
                               capture_output=True, text=True, preexec_fn=pre,
                               env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
            if r.returncode != 0:
                err = (r.stderr.strip().splitlines() or ["?"])[-1][:80]
                rows.append((n, mode, "-", f"OOM > {a.limit_gib:g} GiB limit ({err})", "-"))
            else:
                j = json.loads(r.stdout.strip().splitlines()[-1])
                rows.append((n, mode if not seg else f"partitioned ({seg}-anchor segments)", j["elements"],
                             f"{j['peak_gib']:.2f}", f"{j['time_s']:.1f}"))
            print(rows[-1], flush=True)
    print(f"\nOne P-EAGLE training step (forward + backward), K={K}, COD r=0.7/r_min=0.2, drafter hidden {H}, "
          f"{LAYERS} layer, draft vocab {VD}; {a.threads} CPU thread(s); peak RSS of the whole process.\n")
    print("| N tokens | mode | elements | peak RSS (GiB) | step time (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
