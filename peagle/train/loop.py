"""Drafter training loop: AdamW, warm-up + cosine, grad clipping, fp32/bf16, atomic checkpoints (model,
optimizer, scheduler, RNG, data position), --resume, and data parallelism under torchrun.

Data order is a pure function of (seed, epoch): each epoch shuffles the documents and packs them into rows
of <= max_tokens tokens; one optimizer step consumes `batch_rows` consecutive rows (the global batch; each
epoch's own number of steps: data.StepPlan). A --resume keeps the settings and documents (resume.py).
Under torchrun rank r takes rows r, r+W, ... of the step; COD sampling is seeded per (seed, epoch, row),
so every row gets the same elements whatever rank runs it.  Losses are divided by the *global* count of
supervised elements (all-reduced before the backward passes) and gradients are summed across ranks by torch's
DistributedDataParallel (see GradSync), so the update equals the single-process update on the same global
batch (gloo on CPU, nccl on CUDA: the backend follows the device, peagle.train.common.dist_setup)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ..device import dtype_name, resolve_dtype, train_compute_dtype, train_dtype_reason
from ..errors import PeagleError
from ..heads.config import HeadConfig, resolve_mask_token
from ..heads.init import from_eagle3, init_head, load_eagle3_into, warm_start
from ..heads.vocab import build_draft_vocab, mappings, token_counts
from ..models.loader import load_target
from ..paths import portable_path, portable_paths
from . import eagle3_loss, peagle_loss
from .common import (
    CheckpointClock,
    all_sum,
    barrier,
    broadcast,
    dist_setup,
    load_checkpoint,
    lr_factor,
    resolve_device,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import TrainConfig
from .data import MIN_SUPERVISED, StepPlan, load_docs, skipped_note
from .features import Teacher, pack_row, to_device
from .hidden_states import HiddenStateCache, default_layer_ids, extract, is_cache
from .mask import MaskTable
from .resume import GracefulInterrupt, check_resume, docs_fingerprint, trim_log
from .train_linear import install_linears
from .train_ops import install_ops


class GradSync(torch.nn.Module):
    """Data parallelism through torch's DistributedDataParallel, gradient-accumulation style: each rank runs
    its rows' forward/backward passes on the plain head (several backward calls per row under sequence
    partitioning, which DDP's one-backward-per-forward reducer cannot follow), so gradients only accumulate
    locally; then one forward of this module through DDP returns 0 * (every trainable parameter), and its
    backward makes DDP's reducer all-reduce the accumulated .grad buckets.  A SUM comm hook replaces DDP's
    mean, because the losses are already divided by the global count of supervised elements."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self):
        return sum((p * 0).sum() for p in self.head.parameters() if p.requires_grad)

    @staticmethod
    def wrap(head, world: int):
        if world <= 1:
            return None
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(GradSync(head), broadcast_buffers=False)

        def all_reduce_sum(_, bucket):
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, all_reduce_sum)
        return ddp


# ----------------------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, cfg: TrainConfig | argparse.Namespace):
        c = self.cfg = cfg if isinstance(cfg, TrainConfig) else TrainConfig.from_namespace(cfg)
        # one device for the run: the target (features) and the head live on it. The dtype is the target's
        # and, when not float32, the head's autocast compute dtype (weights stay float32); "auto" on a CPU
        # keeps the target (the teacher) in float32 and autocasts the head to bfloat16 where the CPU has AMX-BF16
        self.device = resolve_device(c.device)
        run_dtype = resolve_dtype(c.dtype, self.device)
        head_dtype = train_compute_dtype(c.dtype, self.device)
        self.rank, self.world = dist_setup(self.device)
        if c.threads:
            torch.set_num_threads(c.threads)
        self.method = c.method
        self.K = c.depths if c.method == "peagle" else c.ttt_steps
        self.dtype = None if head_dtype == torch.float32 else head_dtype
        self.target = load_target(c.target, dtype=run_dtype, backend=c.target_backend,
                                  device=self.device)
        # --data: `peagle datagen` token shards, or a hidden-state cache (speculators' format) made elsewhere
        # (hs_ids[i]: the cache sample of document i; samples with < 2 supervised tokens are left out, as
        # load_docs leaves out such documents)
        self.hs = HiddenStateCache(c.data) if is_cache(c.data) else None
        counts = {}
        if self.hs is not None:
            self.hs_ids, self.docs = self.hs.usable_docs(c.max_docs, counts)
        else:
            self.docs = load_docs(c.data, c.max_docs, counts=counts)
            self.hs_ids = list(range(len(self.docs)))
        note = skipped_note(counts["read"], counts["skipped"])
        if note and self.docs and self.rank == 0:      # (none left: the error below says why)
            print(f"train: {note}", file=sys.stderr, flush=True)
        if not self.docs:
            raise PeagleError(f"--data {c.data}: no document with at least {MIN_SUPERVISED} supervised tokens: "
                              "nothing to train on")
        self.lengths = [len(d[0]) for d in self.docs]
        os.makedirs(c.out, exist_ok=True)
        self.ckpt_dir = os.path.join(c.out, "checkpoint")
        self.fingerprint = docs_fingerprint(self.docs)
        ck = self._load_ckpt() if c.resume else None
        if ck is not None:
            check_resume(ck, c.to_dict(), self.fingerprint, self.ckpt_dir)
        V = self.target.cfg.vocab_size
        src = None
        if ck is not None:
            draft_ids = ck["draft_ids"]
            head_cfg = ck["head_cfg"]
        elif c.init:
            src, head_cfg, draft_ids = warm_start(c.init, self.target, c.method)
        elif c.init_from_eagle3:
            if c.method != "peagle":
                raise PeagleError("--init-from-eagle3 starts a P-EAGLE head (--method peagle)")
            src, head_cfg, draft_ids = from_eagle3(c.init_from_eagle3, self.target, c.layers,
                                                   resolve_mask_token(c.target, c.mask_token))
        else:
            counts = token_counts(self.docs, V)
            draft_ids = build_draft_vocab(counts, min(c.draft_vocab or V, V))
            mask = resolve_mask_token(c.target, c.mask_token) if c.method == "peagle" else None
            hc = HeadConfig.for_target(self.target.cfg, c.layers, len(draft_ids), mask, c.aux_ids,
                                       c.intermediate_size)
            problems = hc.validate(self.target.cfg.raw)
            if problems:
                raise PeagleError("drafter head config does not fit the target: " + "; ".join(problems))
            head_cfg = hc.to_dict()
        self.draft_ids = draft_ids
        _, _, self.index = mappings(draft_ids, V)
        self.head = init_head(head_cfg, self.target, draft_ids, c.method, c.seed)
        if c.share_embedding or (src is not None and src.shares_target_embedding):
            self.head.share_embedding(self.target.embed)      # frozen, not stored: the target's own
        if src is not None and src.parallel == self.head.parallel:
            self.head.load_state_dict(src.state_dict())
        elif src is not None:
            load_eagle3_into(self.head, src)
        self.head.to(self.device)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":   # oneDNN's shapes and layouts
            install_linears(self.head)
            install_ops(self.head)
        self.teacher = Teacher(self.target, self.head.aux_ids, draft_ids)
        if self.hs is None and c.feature_cache:        # extract once (resumable), then every run reads it
            if self.rank == 0:
                extract(self.target, [(t[: c.max_tokens], m[: c.max_tokens]) for t, m in self.docs], c.feature_cache,
                        default_layer_ids(self.target.cfg.num_hidden_layers, self.head.aux_ids),
                        model_name=portable_path(c.target), max_tokens=c.max_tokens)
            barrier(self.world)
            self.hs = HiddenStateCache(c.feature_cache)
            self.hs.check_tokens([t[: c.max_tokens] for t, _ in self.docs])
        if self.hs is not None:
            self.hs.check_aux(self.head.aux_ids)
        self.table = MaskTable(c.max_tokens, self.device)
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.ddp = GradSync.wrap(self.head, self.world)
        self.opt = torch.optim.AdamW(params, lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay)
        self.plan = StepPlan(self.lengths, c.max_tokens, c.seed, c.batch_rows)
        self.total = c.steps or self.plan.steps_for(c.epochs)
        warm = max(1, int(c.warmup * self.total)) if c.warmup < 1 else int(c.warmup)
        self.warm = warm
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: self.lr_factor(s, s / max(1, self.total)))
        self.step = 0
        self.elapsed = 0.0
        if ck is not None:
            self.head.load_state_dict(ck["model"])
            self.opt.load_state_dict(ck["opt"])
            self.sched.load_state_dict(ck["sched"])
            self.step, self.elapsed = ck["step"], ck.get("elapsed", 0.0)
            set_rng_state(ck["rng"])
            if self.rank == 0:
                print(f"resumed from {self.ckpt_dir} at step {self.step}", flush=True)

    def lr_factor(self, step, frac):
        """Linear warm-up over `warm` steps, then cosine from 1 to min_lr_ratio as frac goes to 1."""
        w = self.warm / max(1, self.total)
        return lr_factor(step, (frac - w) / max(1e-9, 1 - w), self.warm, self.cfg.min_lr_ratio)

    def _time_schedule(self):
        """With --max-minutes the cosine follows whichever runs out first, steps or wall time, so a run
        stopped by the clock still ends annealed."""
        if self.cfg.max_minutes:
            el = self.elapsed
            if self.world > 1:  # every rank must use the same lr: take rank 0's clock
                el = self.elapsed = float(broadcast(self._stats([el]), self.world))
            frac = max(self.step / max(1, self.total), el / (60 * self.cfg.max_minutes))
            for g in self.opt.param_groups:
                g["lr"] = self.cfg.lr * self.lr_factor(self.step, frac)

    # ---------------------------------------------------------------- data
    def batch_rows(self, step):
        """This step's epoch and the (row index, doc ids) of its global batch that this rank runs."""
        e, rows = self.plan.step_rows(step)
        return e, rows[self.rank::self.world]

    def make_row(self, doc_ids):
        """A packed row (token bookkeeping on the CPU; see pack_row)."""
        docs = [self.docs[i] for i in doc_ids]
        if self.hs is not None:
            M = self.cfg.max_tokens
            feats = [self.hs.features(self.hs_ids[i]) for i in doc_ids]
            feats = [(aux[:M], fin[:M]) for aux, fin in feats]         # pack_row cuts the documents at M
            for i, (aux, _), (t, _) in zip(doc_ids, feats, docs):
                if len(aux) != min(len(t), M):
                    raise PeagleError(f"hidden states of sample {self.hs_ids[i]} cover {len(aux)} tokens, the "
                                      f"document has {min(len(t), M)}: the cache was made from other data")
        else:
            feats = self.teacher.doc_features([d[0][: self.cfg.max_tokens] for d in docs])
        # hard labels read the drafted tokens only: no teacher distribution to compute
        teacher = None if self.cfg.loss == "hard" else self.teacher
        return pack_row(docs, feats, teacher, self.index, self.cfg.max_tokens)

    def _stats(self, values) -> torch.Tensor:
        """float64 on the device (nccl all-reduces device tensors)."""
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    # ---------------------------------------------------------------- step
    def train_step(self, step) -> dict:
        c, K = self.cfg, self.K
        epoch, mine = self.batch_rows(step)
        rows = [(i, self.make_row(d)) for i, d in mine]
        dev = self.device
        self.head.train()
        # the step's statistics accumulate on the device: [loss sum, correct per depth, total per depth]
        stats = torch.zeros(1 + 2 * K, dtype=torch.float64, device=dev)
        correct, total = stats[1:1 + K], stats[1 + K:]
        if self.method == "peagle":
            els = []
            for i, r in rows:  # COD sampling on the CPU (a CPU generator seeded per row), then one copy
                g = torch.Generator().manual_seed((c.seed * 1_000_003 + epoch) * 1_000_003 + i)
                els.append(to_device(peagle_loss.make_elements(r, K, c.cod_r, c.cod_rmin, g), dev))
            denom = all_sum(self._stats([float(sum(int(e["sup"].sum()) for e in els))]), self.world)
            denom = max(float(denom), 1.0)
            for (i, r), e in zip(rows, els):
                st = peagle_loss.row_step(self.head, to_device(r, dev), e, self.table, K, denom, c.segment_len,
                                          autocast_dtype=self.dtype, hard=c.loss == "hard")
                stats[0] += st["kl"]
                correct += st["correct"]
                total += st["total"]
            stats = all_sum(stats, self.world)
            loss = float(stats[0]) / denom
        else:
            plans = []  # anchors per unroll step, drawn on the CPU per row (like COD); None: all of them
            for i, r in rows:
                g = torch.Generator().manual_seed((c.seed * 1_000_003 + epoch) * 1_000_003 + i)
                plans.append(eagle3_loss.ttt_plan(r, K, c.ttt_keep, g))
            counts = self._stats([0.0] * K)
            for (_, r), plan in zip(rows, plans):
                counts += eagle3_loss.step_counts(r, K, plan).to(dev)
            counts = all_sum(counts, self.world).cpu()
            ce = self._stats([0.0] * K)
            for (_, r), plan in zip(rows, plans):
                st = eagle3_loss.row_step(self.head, to_device(r, dev), self.table, K, counts, c.decay,
                                          autocast_dtype=self.dtype, plan=plan, hard=c.loss == "hard")
                ce += st["ce"]
                correct += st["correct"]
                total += st["total"]
            stats, ce = all_sum(stats, self.world), all_sum(ce, self.world).cpu()
            loss = float(sum((c.decay ** k) * ce[k] / max(float(counts[k]), 1.0) for k in range(K)))
        params = [p for p in self.head.parameters() if p.requires_grad]
        if self.ddp is not None:
            self.ddp().backward()  # DDP sums every rank's accumulated gradients (see GradSync)
        gnorm = torch.nn.utils.clip_grad_norm_(params, c.clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        stats = stats.cpu()  # the step's one host copy of its statistics
        correct, total = stats[1:1 + K], stats[1 + K:]
        return {"loss": loss, "gnorm": float(gnorm), "correct": correct, "total": total, "lr": lr}

    def _bcast_flag(self, flag: bool) -> bool:
        return bool(broadcast(torch.tensor([int(flag)], device=self.device), self.world))

    # ---------------------------------------------------------------- checkpoints
    def _load_ckpt(self):
        return load_checkpoint(os.path.join(self.ckpt_dir, "ckpt.pt"))

    def save_ckpt(self):
        if self.rank != 0:
            return
        os.makedirs(self.ckpt_dir, exist_ok=True)
        fn = os.path.join(self.ckpt_dir, "ckpt.pt")
        epoch, in_epoch = self.plan.locate(self.step)
        ck = {"model": self.head.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
              "step": self.step, "elapsed": self.elapsed, "draft_ids": self.draft_ids, "head_cfg": self.head.cfg,
              "rng": rng_state(),
              "data": {"epoch": epoch, "step_in_epoch": in_epoch, "fingerprint": self.fingerprint,
                       "seed": self.cfg.seed, "max_tokens": self.cfg.max_tokens, "batch_rows": self.cfg.batch_rows},
              "config": self.cfg.to_dict()}
        save_checkpoint(fn, ck)

    def save_head(self, extra_stats: dict):
        if self.rank != 0:
            return
        c = self.cfg
        info = {"method": self.method, "layers": self.head.config.num_hidden_layers, "draft_vocab_size": len(self.draft_ids),
                "steps": self.step, "train_time_s": round(self.elapsed, 1), "max_tokens": c.max_tokens,
                "batch_rows": c.batch_rows, "lr": c.lr, "world_size": self.world,
                "data": portable_paths(c.data), "docs": len(self.docs),
                "init": portable_path(c.init), **extra_stats}
        if c.init_from_eagle3:
            info["init_from_eagle3"] = portable_path(c.init_from_eagle3)
        if self.method == "peagle":
            info.update(train_depths=self.K, cod_r=c.cod_r, cod_rmin=c.cod_rmin, segment_len=c.segment_len)
        else:
            info.update(ttt_steps=self.K, decay=c.decay, ttt_keep=c.ttt_keep)
        info["loss"] = c.loss
        if c.save_dtype == "bf16":  # halves the shipped file; buffers stay int/bool
            import copy
            copy.deepcopy(self.head).to(torch.bfloat16).save_pretrained(c.out, extra={"peagle": info, "torch_dtype": "bfloat16"})
        else:
            self.head.save_pretrained(c.out, extra={"peagle": info, "torch_dtype": "float32"})

    # ---------------------------------------------------------------- run
    def run(self):
        c = self.cfg
        bar = None
        if self.rank == 0 and not c.quiet:
            from tqdm import tqdm
            why = train_dtype_reason(c.dtype, self.device)
            auto_why = f"; auto: {why}" if why else ""
            print(f"train {self.method}: target {c.target} ({dtype_name(self.target.dtype)}), "
                  f"{self.device.type}, head compute "
                  f"{dtype_name(self.dtype or torch.float32)} (weights float32{auto_why})", flush=True)
            bar = tqdm(total=self.total, initial=self.step, desc=f"train {self.method}", unit="step")
        log_fn = os.path.join(c.out, "train_log.jsonl")
        if self.rank == 0:
            trim_log(log_fn, self.step)          # a resumed run logs the steps after its checkpoint again
        log = open(log_fn, "a") if self.rank == 0 else None
        acc_c, acc_t, losses = torch.zeros(self.K, dtype=torch.float64), torch.zeros(self.K, dtype=torch.float64), []
        stop_at = time.time() + c.max_minutes * 60 - self.elapsed if c.max_minutes else None
        ckpt_clock = CheckpointClock(steps=c.ckpt_every)
        interrupt = GracefulInterrupt()
        try:
            self._loop(c, bar, log, acc_c, acc_t, losses, stop_at, ckpt_clock, interrupt)
        finally:
            interrupt.restore()
        if bar:
            bar.close()
        self.save_ckpt()
        rec = getattr(self, "last_log", None) or {}
        self.save_head({"final_loss": rec.get("loss"), "final_acc": rec.get("acc")})
        if log:
            log.close()
        if interrupt.hit:
            if self.rank == 0:
                print(f"\ntrain: stopped at step {self.step} of {self.total} (Ctrl-C): checkpoint and head saved in "
                      f"{c.out}; the same command with --resume continues", file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        return rec

    def _loop(self, c, bar, log, acc_c, acc_t, losses, stop_at, ckpt_clock, interrupt):
        """The optimizer steps from self.step on, until the total, --max-minutes or a Ctrl-C (after its step)."""
        while self.step < self.total:
            t0 = time.time()
            self._time_schedule()
            st = self.train_step(self.step)
            self.step += 1
            self.elapsed += time.time() - t0
            acc_c += st["correct"]
            acc_t += st["total"]
            losses.append(st["loss"])
            stopping = self._bcast_flag(bool(stop_at) and time.time() > stop_at or interrupt.hit)
            if self.step % c.log_every == 0 or self.step == self.total or stopping:
                acc = (acc_c / acc_t.clamp(min=1)).tolist()
                rec = {"step": self.step, "loss": sum(losses) / len(losses), "lr": st["lr"], "gnorm": st["gnorm"],
                       "acc": [round(x, 4) for x in acc], "n": acc_t.tolist(), "time_s": round(self.elapsed, 1)}
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                if bar:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc="/".join(f"{x:.2f}" for x in acc[:4]))
                self.last_log = rec
                acc_c.zero_()
                acc_t.zero_()
                losses = []
            if bar:
                bar.update(1)
            if ckpt_clock.due(self.step):
                self.save_ckpt()
            if c.kill_at_step and self.step == c.kill_at_step:  # test hook: simulate a crash after a checkpoint
                os._exit(17)
            if stopping:
                if self.rank == 0 and not interrupt.hit:
                    print(f"\nstopping at step {self.step}: --max-minutes reached", flush=True)
                break
