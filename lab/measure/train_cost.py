"""Drafter training cost per supervised token, recipe variants side by side in one process on the same rows.

Each variant runs the forward + backward of the same packed rows (the optimizer step is the same for all and
left out); rounds alternate the variants so a change in machine load hits all of them alike.  Supervised
tokens = answer tokens a row supervises at depth 1 (what one epoch of the data provides); per-depth element
counts say how much deeper supervision each variant keeps.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/train_cost.py --data data/smol-self-hs --rows 3 --rounds 2 \\
        --out docs/training-study/train-cost.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags
from peagle.train import eagle3_loss, peagle_loss
from peagle.train.config import TrainConfig
from peagle.train.features import to_device
from peagle.train.loop import Trainer

# (method, name, overrides): the shipped recipe first per method
VARIANTS = [
    ("eagle3", "shipped (all anchors x 7 steps, 1 thread)", {}),
    ("eagle3", "anchors keep 0.7^k, 1 thread", {"ttt_keep": 0.7}),
    ("eagle3", "anchors keep 0.7^k, 2 threads", {"ttt_keep": 0.7, "threads": 2}),
    ("eagle3", "all anchors, 2 threads", {"threads": 2}),
    ("peagle", "shipped (COD r 0.5, 1 thread)", {}),
    ("peagle", "COD r 0.5, 2 threads", {"threads": 2}),
    ("peagle", "COD r 0.35 / rmin 0.05, 1 thread", {"cod_r": 0.35, "cod_rmin": 0.05}),
]


def step_rows(tr: Trainer, rows, over: dict):
    """Forward + backward of the rows under the variant; returns (supervised tokens, elements per depth)."""
    c, K = tr.cfg, tr.K
    torch.set_num_threads(over.get("threads", 1))
    sup0, per = 0, torch.zeros(K, dtype=torch.long)
    for i, r in rows:
        g = torch.Generator().manual_seed(i)
        if tr.method == "peagle":
            el = peagle_loss.make_elements(r, K, over.get("cod_r", c.cod_r), over.get("cod_rmin", c.cod_rmin), g)
            st = peagle_loss.row_step(tr.head, to_device(r, tr.device), el, tr.table, K, 1000.0, c.segment_len)
        else:
            plan = eagle3_loss.ttt_plan(r, K, over.get("ttt_keep", 1.0), g)
            counts = eagle3_loss.step_counts(r, K, plan)
            st = eagle3_loss.row_step(tr.head, r, tr.table, K, counts, c.decay, plan=plan)
        sup0 += int(st["total"][0])
        per += st["total"].cpu()
    tr.head.zero_grad(set_to_none=True)
    return sup0, per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="models/smollm2-135m-instruct")
    ap.add_argument("--data", default="data/smol-self-hs")
    ap.add_argument("--eagle3-head", default="models/smollm2-135m-instruct-eagle3")
    ap.add_argument("--peagle-head", default="models/smollm2-135m-instruct-peagle")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=3, help="packed rows per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trainers, res = {}, {}
    for method, head, extra in (("eagle3", a.eagle3_head, {"layers": 1, "ttt_steps": 7}),
                                ("peagle", a.peagle_head, {"layers": 2, "depths": 8, "cod_r": 0.5, "cod_rmin": 0.1})):
        cfg = TrainConfig(method=method, target=a.target, data=a.data, out=f"/tmp/train_cost_{method}",
                          init=head, share_embedding=True, max_tokens=a.max_tokens, quiet=True, **extra)
        tr = trainers[method] = Trainer(cfg)
        tr.head.train()
        rows = [(i, tr.make_row(d)) for i, d in tr.batch_rows(0)[1]]
        for s in range(1, a.rows):
            rows += [(s * 1000 + i, tr.make_row(d)) for i, d in tr.batch_rows(s)[1]]
        tr.rows = rows
        step_rows(tr, rows[:1], {})  # warm-up
    for rnd in range(a.rounds):
        for method, name, over in VARIANTS:
            tr = trainers[method]
            t0 = time.perf_counter()
            sup, per = step_rows(tr, tr.rows, over)
            dt = time.perf_counter() - t0
            r = res.setdefault(name, {"method": method, "s": 0.0, "sup": 0, "per": per * 0,
                                      "threads": over.get("threads", 1)})
            r["s"] += dt
            r["sup"] += sup
            r["per"] += per
            print(f"round {rnd} {method:6s} {name:42s} {sup / dt:7.1f} supervised tok/s", flush=True)
    lines = [f"# Drafter training cost per supervised token ({cpu_flags()})", "",
             "Regenerate: `OMP_NUM_THREADS=2 .venv/bin/python lab/measure/train_cost.py --data " + a.data +
             f" --rows {a.rows} --rounds {a.rounds}`", "",
             f"Same {a.rows} packed rows of {a.max_tokens} tokens per variant, forward + backward, rounds "
             "alternating the variants. CPU-seconds = wall x threads.", "",
             "| method | variant | supervised tok/s | per CPU-second | x shipped (CPU) | elements per depth / row |",
             "|---|---|---|---|---|---|"]
    base = {}
    for name, r in res.items():
        rate = r["sup"] / r["s"]
        cpu_rate = rate / r["threads"]
        base.setdefault(r["method"], cpu_rate)
        per = "/".join(str(int(x) // (a.rows * a.rounds)) for x in r["per"])
        lines.append(f"| {r['method']} | {name} | {rate:.0f} | {cpu_rate:.0f} | {cpu_rate / base[r['method']]:.2f} | "
                     f"{per} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
