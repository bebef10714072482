"""Training helpers shared by the trainer tests: a few steps' losses of a fresh Trainer."""
from __future__ import annotations

import argparse

from peagle.cli import train as cli


def trainer_losses(target, data, out, method, extra=(), steps: int = 6) -> list[dict]:
    """The per-step records of `steps` optimizer steps of a fresh Trainer (2 rows of 192 tokens per step)."""
    from peagle.train.loop import Trainer
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    a = ap.parse_args(["--method", method, "--target", target, "--data", data, "--out", out, "--layers", "1",
                       "--draft-vocab", "384", "--max-tokens", "192", "--batch-rows", "2", "--steps", str(steps),
                       "--ckpt-every", "0", "--quiet", "--threads", "1", "--device", "cpu", *extra])
    a.max_docs = None
    t = Trainer(a)
    return [t.train_step(s) for s in range(steps)]
