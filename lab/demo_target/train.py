"""Train the embedded demo target model (a small ``LlamaForCausalLM``).

    python -m lab.demo_target.train --out models/demo-target --time-budget-min 60

Steps (each cached under ``--data-dir``): build the corpus
(:mod:`peagle.data.corpus`), train the tokenizer
(:mod:`lab.demo_target.tokenizer`), tokenize to uint16 memmaps, then train on
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
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peagle.data.corpus import build_corpus
from peagle.models.files import load_tensors, read_config
from peagle.train.common import (
    CheckpointClock,
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

from .model import demo_config
from .threads import ThreadTuner
from .tokenizer import build_tokenizer, generation_config_dict
from .tokens import SOURCES, eval_loss, get_rows, heldout_rows, load_tokens, row_order, tokenize_corpus, unigram_loss


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.demo_target.train", description=__doc__,
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


@dataclass
class Corpus:
    """The training data of a run: tokenizer, token memmaps (``bins``), the train split per source and the
    seed's row order."""
    tok: object
    bins: dict
    train_tok: list
    order: object
    n_train_tokens: dict


def prepare_data(args) -> Corpus:
    """Corpus, tokenizer and token memmaps (each cached under --data-dir), and the order of the training rows."""
    data = Path(args.data_dir)
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
    return Corpus(tok, bins, train_tok, order, n_train_tokens)


def build_model(args, device):
    """(config, model on the device, parameter count): the demo shape, or the shape flags'; --init's weights."""
    from transformers import LlamaForCausalLM

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
    return cfg, model, n_params


def make_optimizer(model, args):
    """AdamW; weight decay on matrices only."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


class Run:
    """One training run's state (model, optimizer, position, schedule) and its steps: resume, train, checkpoint.

    Schedule: --max-tokens fixes the number of steps; otherwise a --time-budget-min sizes it from the measured
    step time (first estimate 8 steps after the start or resume, refined every 100 steps; until then the cosine
    keeps the checkpoint's length); with neither the run is 1000 steps."""

    def __init__(self, args, cfg, model, opt, corpus: Corpus, device):
        self.args, self.cfg, self.model, self.opt, self.corpus, self.device = args, cfg, model, opt, corpus, device
        self.ckpt_path = Path(args.run_dir) / "ckpt.pt"
        self.tokens_per_step = args.batch_size * args.seq_len
        self.total_steps = int(args.max_tokens // self.tokens_per_step) if args.max_tokens else None
        self.step, self.train_seconds, self.sizing, self.loss_ema = 0, 0.0, None, None
        self.step_times: list[float] = []

    def resume(self) -> None:
        """--resume: the last checkpoint's model, optimizer, position, schedule and RNG (if one exists)."""
        args = self.args
        st = load_checkpoint(self.ckpt_path) if args.resume else None
        if st is not None:
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["optimizer"])
            self.step, self.train_seconds = st["step"], st["train_seconds"]
            self.total_steps, self.sizing, self.loss_ema = st["total_steps"], st.get("sizing"), st.get("loss_ema")
            set_rng_state(st["rng"])
            if st.get("start_row", 0) != args.start_row:
                raise SystemExit(f"--resume: the checkpoint started at row {st.get('start_row', 0)}, "
                                 f"not --start-row {args.start_row}")
            print(f"resumed from {self.ckpt_path} at step {self.step} ({self.train_seconds:.0f}s trained)",
                  flush=True)
        elif args.resume:
            print(f"--resume: no checkpoint at {self.ckpt_path}, starting fresh", flush=True)
        self.budget_s = args.time_budget_min * 60 if args.time_budget_min else None
        self.size_by_time = self.budget_s is not None and args.max_tokens is None
        self.resize_at = self.step + 8  # first (re-)estimate of the schedule length, also after a resume
        self.sched_total = self.total_steps  # the lr schedule keeps the old length until re-sized
        if self.size_by_time:
            self.total_steps = None
        if self.total_steps is None and self.budget_s is None:
            self.total_steps = 1000

    def checkpoint(self) -> None:
        args = self.args
        save_checkpoint(self.ckpt_path, {
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
            "total_steps": self.total_steps, "train_seconds": self.train_seconds, "sizing": self.sizing,
            "loss_ema": self.loss_ema, "rng": rng_state(), "start_row": args.start_row,
            "data_position": args.start_row + self.step * args.batch_size,
            "args": vars(args), "config": self.cfg.to_dict()})

    def stop_reason(self) -> str | None:
        """Why the run ends before this step (None: it goes on)."""
        if self.total_steps is not None and self.step >= self.total_steps:
            return "schedule"
        if self.args.max_steps is not None and self.step >= self.args.max_steps:
            return "max steps"
        if self.budget_s is not None and self.train_seconds >= self.budget_s:
            return "time budget"
        return None

    def lr(self) -> float:
        args = self.args
        est_total = self.total_steps if self.total_steps is not None else (self.sched_total or 10 ** 9)
        return args.lr * lr_factor(self.step, cosine_progress(self.step, est_total, args.warmup_steps),
                                   args.warmup_steps, args.min_lr_ratio)

    def train_step(self, lr: float):
        """One optimizer step at this lr -> (loss, grad norm)."""
        import torch

        args, c = self.args, self.corpus
        for g in self.opt.param_groups:
            g["lr"] = lr
        x = get_rows(c.train_tok, c.order, args.start_row + self.step * args.batch_size, args.batch_size,
                     args.seq_len).to(self.device)
        loss = self.model(input_ids=x, labels=x).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.grad_clip)
        self.opt.step()
        return loss.item(), gnorm

    def resize(self) -> bool:
        """Size the cosine schedule to the time budget from the measured speed; True when it did."""
        if not (self.size_by_time and (self.step == self.resize_at or
                                       (self.step > self.resize_at and self.step % 100 == 0))):
            return False
        recent = self.step_times[-100:] if len(self.step_times) > 8 else self.step_times[2:]
        per = float(np.median(recent))
        remaining = max(0.0, self.budget_s - self.train_seconds)
        self.total_steps = max(self.step + 1, self.step + int(remaining / per))
        self.sizing = {"at_step": self.step, "sec_per_step": per, "total_steps": self.total_steps}
        return True

    def log(self, lv: float, lr: float, threads: "ThreadTuner") -> None:
        step, tps, args = self.step, self.tokens_per_step, self.args
        if step % 50 == 0 and args.log_json:
            with open(args.log_json, "a") as f:
                f.write(json.dumps({"step": step, "tokens": step * tps, "train_s": round(self.train_seconds, 1),
                                    "loss_ema": round(self.loss_ema, 4), "lr": lr}) + "\n")
        if step % 50 == 0:
            print(f"\nstep {step}/{self.total_steps} loss {lv:.4f} ema {self.loss_ema:.4f} lr {lr:.2e} "
                  f"tok/s {tps * len(self.step_times[-50:]) / sum(self.step_times[-50:]):,.0f} "
                  f"tokens {step * tps:,} train_s {self.train_seconds:.0f} threads {threads.best}", flush=True)

    def train(self, threads: "ThreadTuner") -> str:
        """Steps until the schedule, --max-steps or the time budget ends the run; checkpoints every --ckpt-min
        minutes and at the end.  Returns why it stopped."""
        from tqdm import tqdm

        self.model.train()
        clock = CheckpointClock(minutes=self.args.ckpt_min)
        pbar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True, mininterval=5.0,
                    file=sys.stdout)
        while (stop := self.stop_reason()) is None:
            nthr = threads.before_step()
            t0 = time.time()
            lr = self.lr()
            lv, gnorm = self.train_step(lr)
            dt = time.time() - t0
            self.train_seconds += dt
            threads.after_step(nthr, dt)
            self.step += 1
            self.step_times.append(dt)
            self.loss_ema = lv if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * lv
            if self.resize():
                pbar.total = self.total_steps
                pbar.refresh()
            pbar.update(1)
            pbar.set_postfix(loss=f"{lv:.3f}", ema=f"{self.loss_ema:.3f}", lr=f"{lr:.2e}",
                             tok_s=f"{self.tokens_per_step / dt:,.0f}", thr=nthr, gn=f"{float(gnorm):.2f}",
                             refresh=False)
            self.log(lv, lr, threads)
            if clock.due(self.step):
                self.checkpoint()
                clock.restart()
        pbar.close()
        self.checkpoint()
        tokens = self.step * self.tokens_per_step
        print(f"training stopped ({stop}) at step {self.step}: {tokens:,} tokens, {self.train_seconds:.0f}s, "
              f"{tokens / max(self.train_seconds, 1e-9):,.0f} tok/s", flush=True)
        return stop


def evaluate_heldout(model, cfg, corpus: Corpus, args, device) -> dict:
    """Held-out loss per source vs the unigram baseline of its training split."""
    out = {}
    for i, s in enumerate(SOURCES):
        rows = heldout_rows(load_tokens(corpus.bins[f"{s}.heldout"]), args.eval_rows, args.seq_len)
        counts = np.bincount(np.asarray(corpus.train_tok[i]), minlength=cfg.vocab_size)
        lm = eval_loss(model, rows, device)
        uni = unigram_loss(counts, rows)
        out[s] = {"rows": int(len(rows)), "loss": round(lm, 4), "unigram_loss": round(uni, 4),
                  "ppl": round(math.exp(lm), 2)}
        print(f"held-out {s}: loss {lm:.4f} (ppl {math.exp(lm):.1f}) vs unigram {uni:.4f}", flush=True)
    return out


def write_model_dir(out: Path, model, tok, stats: dict) -> None:
    """The HF model directory: weights, tokenizer, generation_config.json, training_stats.json."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.cpu().save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {**generation_config_dict(), "_from_model_config": False}, indent=2))
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2))
    print(f"wrote {out}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    tune_malloc()
    cmd = "python -m lab.demo_target.train " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    threads = ThreadTuner(args.threads)
    device = resolve_device(args.device)
    corpus = prepare_data(args)
    cfg, model, n_params = build_model(args, device)
    run = Run(args, cfg, model, make_optimizer(model, args), corpus, device)
    run.resume()
    stop_reason = run.train(threads)

    tokens = run.step * run.tokens_per_step
    stats: dict = {"command": cmd, "params": n_params, "steps": run.step, "tokens_trained": tokens,
                   "train_seconds": round(run.train_seconds, 1),
                   "tokens_per_second": round(tokens / max(run.train_seconds, 1e-9), 1),
                   "stop_reason": stop_reason, "final_train_loss_ema": run.loss_ema, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "start_row": args.start_row, "peak_lr": args.lr,
                   "schedule_sizing": run.sizing, "seed": args.seed,
                   "device": str(device), "train_corpus_tokens": corpus.n_train_tokens, "heldout": {}}
    stats["heldout"] = evaluate_heldout(model, cfg, corpus, args, device)
    write_model_dir(Path(args.out), model, corpus.tok, stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
