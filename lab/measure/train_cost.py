"""Drafter training cost per supervised token, recipe variants side by side in one process on the same rows.

Each variant runs the forward + backward of the same packed rows (the optimizer step is the same for all and
left out); rounds alternate the variants so a change in machine load hits all of them alike.  Supervised
tokens = answer tokens a row supervises at depth 1 (what one epoch of the data provides); per-depth element
counts say how much deeper supervision each variant keeps.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/train_cost.py --data data/self5-hs --rows 3 --rounds 3 \\
        --whole-steps 6
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags
from peagle.sampling import greedy
from peagle.train import eagle3_loss, head_forward, peagle_loss, train_attention
from peagle.train.common import tune_malloc
from peagle.train.config import TrainConfig
from peagle.train.features import to_device
from peagle.train.loop import Trainer
from peagle.train.train_linear import PAD_ROWS, install_linears, pad_linear_rows
from peagle.train.train_ops import install_ops

# (method, name, overrides): the shipped recipe first per method. "loss": "op" = the KL over the draft vocabulary
# op by op on gathered rows, as shipped, "blocks" = DraftKL's torch form (the default is its C++ kernel where the
# extension runs: head_forward.FUSED_KL); "deep_block": P-EAGLE's deep elements
# per attention block (default peagle_loss.DEEP_BLOCK); "segment_len": P-EAGLE's anchors per segment (default the
# TrainConfig's); "attn": "sdpa" = torch's flash attention instead of train_attention's kernel (bf16 only);
# "linears" (bf16 only): "peagle" = train_linear's products (the Trainer's), "torch" = torch's linear on rows padded
# to 64 (pad_linear_rows), "none" = torch's linear on the rows as they come; "ops": "torch" = autograd's RMSNorm
# and silu * up instead of train_ops' fused passes (bf16 only); "attn": "per-block" = each attention block its own
# autograd node over key slices torch gathers (the previous form: a zero-filled gradient per slice and block);
# "attn": "float32 scores" = the kernel's path without AMX tiles (torch's float32 score products around the softmax
# passes, oneDNN's P V and dS K: what a CPU without AMX-BF16 runs)
ONE_BLOCK = 1 << 30
VARIANTS = [
    ("eagle3", "shipped (all anchors x 7 steps, float32, 1 thread, masked attention, KL op by op)",
     {"by_document": False, "loss": "op"}),
    ("eagle3", "anchors keep 0.7^k, 1 thread", {"ttt_keep": 0.7}),
    ("eagle3", "bf16 autocast, 1 thread", {"bf16": True}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, masked attention, 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "by_document": False}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, rows not padded, 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "linears": "none"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, torch's linears (rows padded), 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "linears": "torch"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, KL op by op, 1 thread", {"bf16": True, "ttt_keep": 0.7, "loss": "op"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, KL in torch blocks, 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "loss": "blocks"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, torch's flash attention, 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "attn": "sdpa"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, attention blocks as separate nodes, 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "attn": "per-block"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, float32 score products (no AMX tiles), 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "attn": "float32 scores"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, torch's RMSNorm and SwiGLU, 1 thread",
     {"bf16": True, "ttt_keep": 0.7, "ops": "torch"}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, 1 thread", {"bf16": True, "ttt_keep": 0.7}),
    ("eagle3", "bf16 autocast, anchors keep 0.7^k, 2 threads", {"bf16": True, "ttt_keep": 0.7, "threads": 2}),
    ("peagle", "shipped (COD r 0.5, float32, 1 thread, masked attention, KL op by op, segments of 512)",
     {"by_document": False, "loss": "op", "segment_len": 512}),
    ("peagle", "attention by document, float32, 1 thread", {}),
    ("peagle", "COD r 0.5, 2 threads", {"threads": 2}),
    ("peagle", "COD r 0.35 / rmin 0.05, 1 thread", {"cod_r": 0.35, "cod_rmin": 0.05}),
    ("peagle", "bf16 autocast, COD r 0.7 / rmin 0.2 (speculators' n*0.7^d), 1 thread",
     {"bf16": True, "cod_r": 0.7, "cod_rmin": 0.2}),
    ("peagle", "bf16 autocast, masked attention, 1 thread", {"bf16": True, "by_document": False}),
    ("peagle", "bf16 autocast, rows not padded, 1 thread", {"bf16": True, "linears": "none"}),
    ("peagle", "bf16 autocast, torch's linears (rows padded), 1 thread", {"bf16": True, "linears": "torch"}),
    ("peagle", "bf16 autocast, KL op by op, 1 thread", {"bf16": True, "loss": "op"}),
    ("peagle", "bf16 autocast, KL in torch blocks, 1 thread", {"bf16": True, "loss": "blocks"}),
    ("peagle", "bf16 autocast, one deep attention block per segment, 1 thread", {"bf16": True, "deep_block": ONE_BLOCK}),
    ("peagle", "bf16 autocast, segments of 512 anchors, 1 thread", {"bf16": True, "segment_len": 512}),
    ("peagle", "bf16 autocast, torch's flash attention, 1 thread", {"bf16": True, "attn": "sdpa"}),
    ("peagle", "bf16 autocast, attention blocks as separate nodes, 1 thread", {"bf16": True, "attn": "per-block"}),
    ("peagle", "bf16 autocast, float32 score products (no AMX tiles), 1 thread",
     {"bf16": True, "attn": "float32 scores"}),
    ("peagle", "bf16 autocast, torch's RMSNorm and SwiGLU, 1 thread", {"bf16": True, "ops": "torch"}),
    ("peagle", "bf16 autocast, 1 thread", {"bf16": True}),
    ("peagle", "bf16 autocast, 2 threads", {"bf16": True, "threads": 2}),
]


def kl_op_by_op(logits, tlogp, rows, label, hard):
    """The shipped loss: KL(target || draft) on [E, Vd] float32 temporaries of the gathered rows."""
    logq = torch.nn.functional.log_softmax(logits.float(), -1)
    logp = tlogp[rows].float()
    return (logp.exp() * (logp - logq)).sum(-1), greedy(logits)


@contextlib.contextmanager
def variant_code(over: dict):
    """The loss and the attention the variant asks for, restored afterwards."""
    saved = (peagle_loss.draft_loss, eagle3_loss.draft_loss, peagle_loss.DEEP_BLOCK, head_forward.FUSED_KL,
             train_attention.USE_KERNEL, train_attention.AMX_SCORES, head_forward.block_attention,
             train_attention.block_attention)
    head_forward.FUSED_KL = over.get("loss") != "blocks"
    if over.get("attn") == "per-block":
        head_forward.block_attention = train_attention.block_attention = attention_per_block
    train_attention.USE_KERNEL = over.get("attn") != "sdpa"
    train_attention.AMX_SCORES = over.get("attn") != "float32 scores"
    if over.get("loss") == "op":
        peagle_loss.draft_loss = eagle3_loss.draft_loss = kl_op_by_op
    peagle_loss.DEEP_BLOCK = over.get("deep_block", peagle_loss.DEEP_BLOCK)
    try:
        yield
    finally:
        (peagle_loss.draft_loss, eagle3_loss.draft_loss, peagle_loss.DEEP_BLOCK, head_forward.FUSED_KL,
         train_attention.USE_KERNEL, train_attention.AMX_SCORES, head_forward.block_attention,
         train_attention.block_attention) = saved


BLOCKS = train_attention.block_attention


def attention_per_block(q, kv, blocks):
    """train_attention.block_attention with each block its own call over the key slices autograd gathers."""
    one = [(BLOCKS(q[:, a:b], (train_attention._gather(kv[0::2], p), train_attention._gather(kv[1::2], p)),
                   [(0, b - a, [(0, 0, m.shape[1])], m)])) for a, b, p, m in blocks]
    return torch.cat(one, 1)


def head_linears(head, how: str, ops: bool) -> list:
    """The head's linears as the variant asks (handles to remove): "peagle" as the bf16 Trainer installs them; ops:
    train_ops' RMSNorm and SwiGLU too (as the Trainer does)."""
    return {"none": lambda: [], "torch": lambda: pad_linear_rows(head, PAD_ROWS),
            "peagle": lambda: install_linears(head)}[how]() + (install_ops(head) if ops else [])


def step_rows(tr: Trainer, rows, over: dict):
    """Forward + backward of the rows under the variant; returns (supervised tokens, elements per depth)."""
    torch.set_num_threads(over.get("threads", 1))
    sup0, per = 0, torch.zeros(tr.K, dtype=torch.long)
    dt = torch.bfloat16 if over.get("bf16") else None
    pads = head_linears(tr.head, over.get("linears", "peagle") if dt is not None else "none",
                        dt is not None and over.get("ops") != "torch")
    with variant_code(over):
        for i, r in rows:
            t = row_cost(tr, i, r, over, dt)
            sup0, per = sup0 + int(t[0]), per + t
    tr.head.zero_grad(set_to_none=True)
    for h in pads:
        h.remove()
    return sup0, per


def row_cost(tr: Trainer, i: int, r: dict, over: dict, dt) -> torch.Tensor:
    """Forward + backward of one packed row under the variant: supervised elements per depth [K]."""
    c, K = tr.cfg, tr.K
    g = torch.Generator().manual_seed(i)
    if tr.method == "peagle":
        el = peagle_loss.make_elements(r, K, over.get("cod_r", c.cod_r), over.get("cod_rmin", c.cod_rmin), g)
        st = peagle_loss.row_step(tr.head, to_device(r, tr.device), el, tr.table, K, 1000.0,
                                  over.get("segment_len", c.segment_len),
                                  autocast_dtype=dt, by_document=over.get("by_document", True))
    else:
        plan = eagle3_loss.ttt_plan(r, K, over.get("ttt_keep", 1.0), g)
        counts = eagle3_loss.step_counts(r, K, plan)
        st = eagle3_loss.row_step(tr.head, r, tr.table, K, counts, c.decay, plan=plan, autocast_dtype=dt,
                                  by_document=over.get("by_document", True))
    return st["total"].cpu()


CELLS = ("float32", "bf16 not padded", "bf16 torch linears", "bf16 flash attention", "bf16")
CELL_LINEARS = {"float32": "none", "bf16 not padded": "none", "bf16 torch linears": "torch"}


def whole_steps(trainers: dict, n: int, rounds: int) -> list:
    """Seconds per whole Trainer.train_step (the shipped recipes: EAGLE-3 with anchors kept 0.7^k), float32 vs
    bf16 autocast (with torch's flash attention instead of train_attention's kernel, and as shipped) alternating
    on the same steps' rows, new rows every round as in training (bf16's products
    meet each row's shapes for the first time, as they do in a run)."""
    torch.set_num_threads(1)
    secs = {}
    trainers["eagle3"].cfg.ttt_keep = 0.7
    for rnd in range(rounds):
        for method, tr in trainers.items():
            for cell in CELLS:
                tr.dtype = torch.bfloat16 if cell != "float32" else None
                pads = head_linears(tr.head, CELL_LINEARS.get(cell, "peagle"), cell != "float32")
                t0 = time.perf_counter()
                with variant_code({"attn": "sdpa"} if cell == "bf16 flash attention" else {}):
                    for s in range(1 + rnd * n, 1 + (rnd + 1) * n):
                        tr.train_step(s)
                for h in pads:
                    h.remove()
                secs.setdefault((method, cell), []).append((time.perf_counter() - t0) / n)
                print(f"round {rnd} {method:6s} whole step {cell:16s} {secs[method, cell][-1]:.3f} s", flush=True)
    out = ["", f"Whole training steps ({n} steps x {rounds} rounds per cell, one thread; new rows every round, the "
           "same for every cell): row and teacher, forward + backward, AdamW; EAGLE-3 with anchors kept 0.7^k. Median "
           "seconds per step.", "",
           "| method | float32 s/step | bf16, rows not padded | bf16, torch's linears (rows padded) | bf16, torch's "
           "flash attention | bf16 (Trainer) | float32 / bf16 | torch's linears / bf16 | flash attention / bf16 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for method in trainers:
        f, u, tl, fa, b = (sorted(secs[method, c])[len(secs[method, c]) // 2] for c in CELLS)
        out.append(f"| {method} | {f:.3f} | {u:.3f} | {tl:.3f} | {fa:.3f} | {b:.3f} | {f / b:.2f}x | {tl / b:.2f}x | "
                   f"{fa / b:.2f}x |")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="models/smollm2-135m-instruct")
    ap.add_argument("--data", default="data/smol-self-hs")
    ap.add_argument("--eagle3-head", default="models/smollm2-135m-instruct-eagle3")
    ap.add_argument("--peagle-head", default="models/smollm2-135m-instruct-peagle")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=3, help="packed rows per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--whole-steps", type=int, default=0,
                    help="also time this many whole training steps (row + teacher, forward + backward, AdamW) per "
                         "method, float32 and bfloat16 autocast alternating, one thread")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tune_malloc()     # as `peagle train` does
    trainers, res = {}, {}
    for method, head, extra in (("eagle3", a.eagle3_head, {"layers": 1, "ttt_steps": 7}),
                                ("peagle", a.peagle_head, {"layers": 2, "depths": 8, "cod_r": 0.5, "cod_rmin": 0.1})):
        cfg = TrainConfig(method=method, target=a.target, data=a.data,
                          out=os.path.join(tempfile.gettempdir(), f"train_cost_{method}"),
                          init=head, share_embedding=True, max_tokens=a.max_tokens, quiet=True, dtype="float32",
                          **extra)
        tr = trainers[method] = Trainer(cfg)
        tr.head.train()
        rows = [(i, tr.make_row(d)) for i, d in tr.batch_rows(0)[1]]
        for s in range(1, a.rows):
            rows += [(s * 1000 + i, tr.make_row(d)) for i, d in tr.batch_rows(s)[1]]
        tr.rows = rows
    for method, name, over in VARIANTS:    # untimed: every variant's shapes once (bf16 products JIT per shape)
        step_rows(trainers[method], trainers[method].rows, over)
    for rnd in range(a.rounds):
        for method, name, over in VARIANTS:
            tr = trainers[method]
            t0 = time.perf_counter()
            sup, per = step_rows(tr, tr.rows, over)
            dt = time.perf_counter() - t0
            r = res.setdefault((method, name), {"method": method, "s": 0.0, "sup": 0, "per": per * 0,
                                      "threads": over.get("threads", 1)})
            r["s"] += dt
            r["sup"] += sup
            r["per"] += per
            print(f"round {rnd} {method:6s} {name:42s} {sup / dt:7.1f} supervised tok/s", flush=True)
    lines = [f"# Drafter training cost per supervised token ({cpu_flags()})", "",
             "Regenerate: `OMP_NUM_THREADS=2 .venv/bin/python lab/measure/train_cost.py --data " + a.data +
             f" --rows {a.rows} --rounds {a.rounds}" + (f" --whole-steps {a.whole_steps}" if a.whole_steps else "") +
             "`", "",
             f"Same {a.rows} packed rows of {a.max_tokens} tokens per variant, forward + backward, rounds "
             "alternating the variants. CPU-seconds = wall x threads.", "",
             "| method | variant | supervised tok/s | per CPU-second | x shipped (CPU) | elements per depth / row |",
             "|---|---|---|---|---|---|"]
    base = {}
    for (_, name), r in res.items():
        rate = r["sup"] / r["s"]
        cpu_rate = rate / r["threads"]
        base.setdefault(r["method"], cpu_rate)
        per = "/".join(str(int(x) // (a.rows * a.rounds)) for x in r["per"])
        lines.append(f"| {r['method']} | {name} | {rate:.0f} | {cpu_rate:.0f} | {cpu_rate / base[r['method']]:.2f} | "
                     f"{per} |")
    if a.whole_steps:
        lines += whole_steps(trainers, a.whole_steps, a.rounds)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
