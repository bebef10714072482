"""Stopping and resuming a drafter training run: the same run, or a clear refusal.

Invariants: a run resumed from its checkpoint trains on the same documents in the same order with the same
schedule as the run that wrote it (the settings that decide them and a fingerprint of the documents are
compared first, and a difference is one line naming it); the first Ctrl-C lets the step under way finish so
the loop can save; the log holds each step once."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch

from ..errors import PeagleError

# TrainConfig fields that decide the head, the data order or the schedule: a resume must keep them.
RUN_KEYS = ("method", "layers", "intermediate_size", "draft_vocab", "aux_ids", "mask_token", "share_embedding",
            "depths", "ttt_steps", "decay", "ttt_keep", "loss", "cod_r", "cod_rmin", "segment_len", "max_tokens",
            "batch_rows", "epochs", "steps", "max_docs", "lr", "min_lr_ratio", "warmup", "weight_decay", "clip",
            "seed")


def docs_fingerprint(docs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """sha256 of every document's tokens and loss mask, in order."""
    h = hashlib.sha256()
    for t, m in docs:
        h.update(t.to(torch.int64).numpy().tobytes())
        h.update(m.to(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_resume(ck: dict, cfg: dict, fingerprint: str, ckpt_dir: str) -> None:
    """PeagleError if this run's settings or documents differ from those of the checkpoint it resumes."""
    old = ck.get("config") or {}
    diff = [f"--{k.replace('_', '-')} {cfg[k]!r} (checkpoint: {old[k]!r})" for k in RUN_KEYS
            if k in old and old[k] != cfg[k]]
    old_fp = (ck.get("data") or {}).get("fingerprint")
    if old_fp is not None and old_fp != fingerprint:
        diff.append("--data holds other documents than the checkpoint's run trained on")
    if old_fp is None:
        print(f"train: {ckpt_dir} was written by an older peagle (no record of its documents, and epochs after the "
              "first may take other rows now: data.StepPlan): resuming as this version plans them",
              file=sys.stderr, flush=True)
    if diff:
        raise PeagleError(f"--resume from {ckpt_dir}: this run differs from the one that wrote the checkpoint: "
                          f"{'; '.join(diff)}. Resume with the same settings, train into another --out, or go on from "
                          f"this head with a fresh optimizer: --init {os.path.dirname(ckpt_dir)} and a new --out")


class GracefulInterrupt:
    """While training: the first Ctrl-C (SIGINT) only sets `hit`, so the step under way finishes and the loop
    saves a checkpoint and the head before stopping; a second Ctrl-C interrupts at once (the handler before).
    Installed from the main thread only (elsewhere `hit` stays False)."""

    def __init__(self):
        self.hit, self._old = False, None
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:                      # not the main thread
            self._old = None

    def _handle(self, signum, frame):
        self.hit = True
        self.restore()
        print("\ntrain: Ctrl-C: finishing this step, then saving a checkpoint and the head (Ctrl-C again to stop "
              "now)", file=sys.stderr, flush=True)

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def trim_log(fn: str, step: int) -> None:
    """Drop the records of train_log.jsonl past `step` (a resumed run's checkpoint): they are logged again."""
    if not os.path.isfile(fn):
        return
    with open(fn) as f:
        lines = f.readlines()
    keep = [x for x in lines if not x.strip() or json.loads(x).get("step", 0) <= step]
    if len(keep) != len(lines):
        tmp = fn + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, fn)
