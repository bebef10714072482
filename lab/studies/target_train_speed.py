"""Target-training throughput, side by side in one process (issue 12).

    python lab/studies/target_train_speed.py --threads 2 --repeats 3 --steps 6

Compares the trainer as it was (``HF LlamaForCausalLM``, per-parameter AdamW)
with the current one (AdamW ``foreach``) on the v1 demo shape (12x256), in interleaved blocks of ``--steps`` optimizer
steps; the first step of each block is a warm-up and is not timed.  The rows
are real training rows (code and chat, from ``--data-dir``'s token memmaps)
when they exist, else uniform random tokens (say which in the table).  ``--shapes`` also measures candidate model shapes with the
current settings (the recipe study's CPU-time axis).  Prints a markdown table
of medians; fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHAPES = {  # name: (layers, hidden, intermediate, heads, kv_heads)
    "v1-12x256": (12, 256, 688, 4, 2),
    "8x256": (8, 256, 688, 4, 2),
    "8x320": (8, 320, 864, 5, 1),
    "10x384": (10, 384, 1024, 6, 2),
    "16x192": (16, 192, 512, 3, 1),
}


def make(shape, vocab=8192):
    from transformers import LlamaForCausalLM

    from lab.demo_target.model import demo_config

    L, H, I, nh, kv = SHAPES[shape]
    torch.manual_seed(0)
    return LlamaForCausalLM(demo_config(vocab, num_hidden_layers=L, hidden_size=H, intermediate_size=I,
                                        num_attention_heads=nh, num_key_value_heads=kv, head_dim=H // nh))


def block(model, opt, x, steps):
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = model(input_ids=x[i], labels=x[i]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return x[0].numel() * len(times) / sum(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--shapes", default="", help="comma list of extra shapes: " + ",".join(SHAPES))
    ap.add_argument("--data-dir", default="data/target", help="token memmaps of the target corpus (optional)")
    ap.add_argument("--json", default=None, help="write {LAYERSxHIDDEN: tokens/s} of the current trainer here "
                                                 "(lab/studies/target_study.py's CPU-time axis)")
    a = ap.parse_args(argv)
    from peagle.train.common import tune_malloc

    tune_malloc()
    torch.set_num_threads(a.threads)
    from pathlib import Path

    from lab.demo_target.tokens import SOURCES, get_rows, load_tokens, row_order

    bins = [Path(a.data_dir) / "tokens" / f"{s}.train.bin" for s in SOURCES]
    if all(b.exists() for b in bins):
        toks = [load_tokens(b) for b in bins]
        order = row_order({s: len(t) // a.seq_len for s, t in zip(SOURCES, toks)}, 0)
        x = get_rows(toks, order, 0, a.batch_size * a.steps, a.seq_len).view(a.steps, a.batch_size, a.seq_len)
        rows = "real training rows (code and chat, a new batch each step)"
    else:
        g = torch.Generator().manual_seed(0)
        x, rows = torch.randint(6, 8192, (a.steps, a.batch_size, a.seq_len), generator=g), "uniform random tokens"
    runs = {"before (AdamW per parameter)": ("v1-12x256", dict(foreach=False), False),
            "after (AdamW foreach)": ("v1-12x256", dict(foreach=True), True)}
    for s in filter(None, a.shapes.split(",")):
        runs[f"after, shape {s}"] = (s, dict(foreach=True), True)
    state = {}
    for name, (shape, kw, _) in runs.items():
        m = make(shape)
        state[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw))
    res = {n: [] for n in runs}
    for r in range(a.repeats):
        for name in runs:
            res[name].append(block(*state[name], x, a.steps))
            print(f"repeat {r}: {name}: {res[name][-1]:,.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(res[next(iter(runs))])
    cmd = "python lab/studies/target_train_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"`{cmd}` — batch {a.batch_size}x{a.seq_len}, {a.threads} threads, medians of {a.repeats} interleaved "
          f"blocks of {a.steps - 1} timed steps, {rows}\n")
    print("| trainer | params (M) | tokens/s | ratio vs before |\n|---|---|---|---|")
    speeds = {}
    for name, (shape, _, current) in runs.items():
        med = statistics.median(res[name])
        n = sum(p.numel() for p in state[name][0].parameters()) / 1e6
        print(f"| {name} | {n:.2f} | {med:,.0f} | {med / base:.2f}x |")
        if current:
            L, H = SHAPES[shape][:2]
            speeds[f"{L}x{H}"] = round(med, 1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(speeds, f, indent=2)


if __name__ == "__main__":
    main()
