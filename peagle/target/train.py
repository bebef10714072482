"""Train the embedded demo target model (a small ``LlamaForCausalLM``).

    python -m peagle.target.train --out models/demo-target --time-budget-min 60

Steps (each cached under ``--data-dir``): build the corpus
(:mod:`peagle.data.corpus`), train the tokenizer
(:mod:`peagle.target.tokenizer`), tokenize to uint16 memmaps, then train on
packed 512-token rows (documents separated by token 0), half code and half
chat.  Checkpoints (model + optimizer + schedule + RNG + data position) are
written atomically to ``--run-dir`` every ``--ckpt-min`` minutes; ``--resume``
continues from the last one.  At the end the HF model directory is written
with the tokenizer, ``generation_config.json`` and ``training_stats.json``
(held-out code/chat loss vs a unigram baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from ..data.corpus import build_corpus
from ..heads.io import load_tensors, read_config
from ..train.common import (
    cosine_progress,
    load_checkpoint,
    lr_factor,
    resolve_device,
    rng_state,
    save_checkpoint,
    seed_all,
    set_rng_state,
    tune_malloc,
)
from .tokenizer import EOS_ID, PAD_ID, build_tokenizer, generation_config_dict
from .tokens import SOURCES, eval_loss, get_rows, heldout_rows, load_tokens, row_order, tokenize_corpus, unigram_loss


# ---------------------------------------------------------------- model
def demo_config(vocab_size: int = 8192, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02,
    )
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    return cfg


# ------------------------------------------------------------------ main
def load_init(model, path: str) -> None:
    """--init: the weights of an HF model directory of the same shape (warm restart; fresh optimizer)."""
    src, cfg = read_config(path), model.config
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size"):
        if src.get(k) != getattr(cfg, k):
            raise SystemExit(f"--init {path}: {k}={src.get(k)} but this run has {getattr(cfg, k)}")
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in load_tensors(path).items()}, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"--init {path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    print(f"warm restart from {path}", flush=True)


class ThreadTuner:
    """Chooses the torch thread count.  Fixed if ``n > 0``.  Otherwise (auto)
    it runs with the current best count and, every ``period`` steps, tries the
    other count for up to ``probe`` steps (aborting after one step if that step
    is clearly slower), switching when the probe's median step time beats the
    recent median of the current count.  On a 2-vCPU machine shared with other
    jobs, 2 OpenMP threads can be several times slower than 1."""

    def __init__(self, n: int, probe: int = 3, period: int = 50):
        import torch

        self.torch = torch
        self.fixed = n > 0
        self.cands = [n] if n > 0 else list(range(1, min(2, os.cpu_count() or 1) + 1))
        self.probe, self.period = probe, period
        self.best = self.cands[0]
        self.recent: dict[int, list[float]] = {c: [] for c in self.cands}
        self.trial: list[float] = []
        self.alt: int | None = None
        self.k = 0
        self._set(self.best)

    def _set(self, n: int) -> None:
        if self.torch.get_num_threads() != n:
            self.torch.set_num_threads(n)

    def before_step(self) -> int:
        if self.fixed or len(self.cands) == 1:
            return self.best
        if self.alt is None and self.k > 0 and self.k % self.period == 0 and len(self.recent[self.best]) >= 3:
            self.alt = next(c for c in self.cands if c != self.best)
            self.trial = []
        n = self.alt if self.alt is not None else self.best
        self._set(n)
        return n

    def after_step(self, n: int, dt: float) -> None:
        if self.fixed or len(self.cands) == 1:
            return
        self.k += 1
        if self.alt is None:
            self.recent[n] = (self.recent[n] + [dt])[-20:]
            # Startup: the first count tried is compared against the other once.
            if self.k == 4:
                self.alt = next(c for c in self.cands if c != self.best)
                self.trial = []
            return
        self.trial.append(dt)
        ref = float(np.median(self.recent[self.best][-10:]))
        if len(self.trial) >= self.probe or dt > 1.3 * ref:
            if float(np.median(self.trial)) < ref:
                self.best = self.alt
                self.recent[self.best] = list(self.trial)
            self.alt = None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="peagle train-target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/demo-target", help="HF model directory to write")
    ap.add_argument("--data-dir", default="data/target", help="cache: corpus, tokenizer, token memmaps")
    ap.add_argument("--run-dir", default="runs/target", help="checkpoints")
    ap.add_argument("--resume", action="store_true", help="continue from RUN_DIR/ckpt.pt")
    ap.add_argument("--time-budget-min", type=float, default=None,
                    help="stop cleanly after this much training time; cosine sized to it")
    ap.add_argument("--max-tokens", type=float, default=None, help="training tokens (sizes the schedule)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads; 0 = auto: periodically re-pick 1 or 2 threads by measured step time "
                         "(2 threads stall badly when other jobs share the 2 vCPUs)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--ckpt-min", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--eval-rows", type=int, default=256, help="held-out rows per source")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=None, help="model shape (default: the demo shape)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (study runs)")
    ap.add_argument("--init", default=None,
                    help="warm restart: start from this HF model directory's weights (same shape and tokenizer) "
                         "with a fresh optimizer and a new schedule")
    ap.add_argument("--start-row", type=int, default=0,
                    help="begin this many rows into the seed's row order (a warm restart goes on with the rows "
                         "the earlier run did not see: its steps x batch size)")
    ap.add_argument("--log-json", default=None, help="append {step, tokens, train_s, loss, lr} every 50 steps")
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke tests)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import torch
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    args = parse_args(argv)
    tune_malloc()
    cmd = "python -m peagle.target.train " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    threads = ThreadTuner(args.threads)
    device = resolve_device(args.device)
    data = Path(args.data_dir)
    run_dir = Path(args.run_dir)
    ckpt_path = run_dir / "ckpt.pt"

    build_corpus(data / "corpus", seed=args.seed)
    tok = build_tokenizer(data / "corpus", data / "tokenizer", vocab_size=args.vocab_size, seed=args.seed)
    bins = tokenize_corpus(data / "corpus", data / "tokenizer", data / "tokens")

    seq, bs = args.seq_len, args.batch_size
    train_tok = [load_tokens(bins[f"{s}.train"]) for s in SOURCES]
    order = row_order({s: len(t) // seq for s, t in zip(SOURCES, train_tok)}, args.seed)
    n_train_tokens = {s: int(len(t)) for s, t in zip(SOURCES, train_tok)}
    print(f"train tokens: {n_train_tokens}, rows: {len(order):,}", flush=True)
    if not 0 <= args.start_row < len(order):
        raise SystemExit(f"--start-row {args.start_row}: the row order has rows 0..{len(order) - 1}")
    if args.start_row:
        # Past the last row the order starts over, on rows an earlier run already saw.
        print(f"starting at row {args.start_row:,}: {len(order) - args.start_row:,} unseen rows "
              f"({(len(order) - args.start_row) // bs:,} steps) before the order starts over", flush=True)

    seed_all(args.seed)
    shape = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32) if args.tiny else {}
    for flag, key in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("intermediate", "intermediate_size"),
                      ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads")):
        if getattr(args, flag) is not None:
            shape[key] = getattr(args, flag)
    if "hidden_size" in shape or "num_attention_heads" in shape:
        shape["head_dim"] = shape.get("hidden_size", 256) // shape.get("num_attention_heads", 4)
    cfg = demo_config(args.vocab_size, **shape)
    model = LlamaForCausalLM(cfg)
    if args.init:
        load_init(model, args.init)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, device {device}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)

    tokens_per_step = bs * seq
    total_steps = int(args.max_tokens // tokens_per_step) if args.max_tokens else None
    step, train_seconds, sizing = 0, 0.0, None
    loss_ema = None
    st = load_checkpoint(ckpt_path) if args.resume else None
    if st is not None:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step, train_seconds = st["step"], st["train_seconds"]
        total_steps, sizing, loss_ema = st["total_steps"], st.get("sizing"), st.get("loss_ema")
        set_rng_state(st["rng"])
        if st.get("start_row", 0) != args.start_row:
            raise SystemExit(f"--resume: the checkpoint started at row {st.get('start_row', 0)}, "
                             f"not --start-row {args.start_row}")
        print(f"resumed from {ckpt_path} at step {step} ({train_seconds:.0f}s trained)", flush=True)
    elif args.resume:
        print(f"--resume: no checkpoint at {ckpt_path}, starting fresh", flush=True)

    budget_s = args.time_budget_min * 60 if args.time_budget_min else None
    size_by_time = budget_s is not None and args.max_tokens is None
    resize_at = step + 8  # first (re-)estimate of the schedule length, also after a resume
    sched_total = total_steps  # the lr schedule keeps the old length until re-sized
    if size_by_time:
        total_steps = None
    if total_steps is None and budget_s is None:
        total_steps = 1000

    def checkpoint():
        save_checkpoint(ckpt_path, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "total_steps": total_steps, "train_seconds": train_seconds, "sizing": sizing,
            "loss_ema": loss_ema, "rng": rng_state(), "start_row": args.start_row,
            "data_position": args.start_row + step * bs,
            "args": vars(args), "config": cfg.to_dict()})

    model.train()
    last_ckpt = time.time()
    pbar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, mininterval=5.0,
                file=sys.stdout)
    step_times: list[float] = []
    stop_reason = "schedule"
    while True:
        if total_steps is not None and step >= total_steps:
            break
        if args.max_steps is not None and step >= args.max_steps:
            stop_reason = "max steps"
            break
        if budget_s is not None and train_seconds >= budget_s:
            stop_reason = "time budget"
            break
        nthr = threads.before_step()
        t0 = time.time()
        est_total = total_steps if total_steps is not None else (sched_total or 10 ** 9)
        lr = args.lr * lr_factor(step, cosine_progress(step, est_total, args.warmup_steps), args.warmup_steps,
                                 args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        x = get_rows(train_tok, order, args.start_row + step * bs, bs, seq).to(device)
        out = model(input_ids=x, labels=x)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        lv = loss.item()
        dt = time.time() - t0
        train_seconds += dt
        threads.after_step(nthr, dt)
        step += 1
        step_times.append(dt)
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
        # Size the cosine schedule to the time budget from the measured speed
        # (first estimate after 8 steps; refined every 100 steps).
        if size_by_time and (step == resize_at or (step > resize_at and step % 100 == 0)):
            recent = step_times[-100:] if len(step_times) > 8 else step_times[2:]
            per = float(np.median(recent))
            remaining = max(0.0, budget_s - train_seconds)
            total_steps = max(step + 1, step + int(remaining / per))
            sizing = {"at_step": step, "sec_per_step": per, "total_steps": total_steps}
            pbar.total = total_steps
            pbar.refresh()
        pbar.update(1)
        pbar.set_postfix(loss=f"{lv:.3f}", ema=f"{loss_ema:.3f}", lr=f"{lr:.2e}",
                         tok_s=f"{tokens_per_step / dt:,.0f}", thr=nthr, gn=f"{float(gnorm):.2f}", refresh=False)
        if step % 50 == 0 and args.log_json:
            with open(args.log_json, "a") as f:
                f.write(json.dumps({"step": step, "tokens": step * tokens_per_step, "train_s": round(train_seconds, 1),
                                    "loss_ema": round(loss_ema, 4), "lr": lr}) + "\n")
        if step % 50 == 0:
            print(f"\nstep {step}/{total_steps} loss {lv:.4f} ema {loss_ema:.4f} lr {lr:.2e} "
                  f"tok/s {tokens_per_step * len(step_times[-50:]) / sum(step_times[-50:]):,.0f} "
                  f"tokens {step * tokens_per_step:,} train_s {train_seconds:.0f} threads {threads.best}", flush=True)
        if time.time() - last_ckpt >= args.ckpt_min * 60:
            checkpoint()
            last_ckpt = time.time()
    pbar.close()
    checkpoint()
    print(f"training stopped ({stop_reason}) at step {step}: {step * tokens_per_step:,} tokens, "
          f"{train_seconds:.0f}s, {step * tokens_per_step / max(train_seconds, 1e-9):,.0f} tok/s", flush=True)

    # ---- held-out evaluation vs unigram baseline
    stats: dict = {"command": cmd, "params": n_params, "steps": step, "tokens_trained": step * tokens_per_step,
                   "train_seconds": round(train_seconds, 1),
                   "tokens_per_second": round(step * tokens_per_step / max(train_seconds, 1e-9), 1),
                   "stop_reason": stop_reason, "final_train_loss_ema": loss_ema, "seq_len": seq,
                   "batch_size": bs, "start_row": args.start_row, "peak_lr": args.lr, "schedule_sizing": sizing,
                   "seed": args.seed,
                   "device": str(device), "train_corpus_tokens": n_train_tokens, "heldout": {}}
    for i, s in enumerate(SOURCES):
        rows = heldout_rows(load_tokens(bins[f"{s}.heldout"]), args.eval_rows, seq)
        counts = np.bincount(np.asarray(train_tok[i]), minlength=cfg.vocab_size)
        lm = eval_loss(model, rows, device)
        uni = unigram_loss(counts, rows)
        stats["heldout"][s] = {"rows": int(len(rows)), "loss": round(lm, 4), "unigram_loss": round(uni, 4),
                               "ppl": round(math.exp(lm), 2)}
        print(f"held-out {s}: loss {lm:.4f} (ppl {math.exp(lm):.1f}) vs unigram {uni:.4f}", flush=True)

    # ---- write the HF model directory
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.cpu().save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {**generation_config_dict(), "_from_model_config": False}, indent=2))
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
