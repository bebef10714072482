"""What every peagle trainer shares: device, heap settings, the learning-rate schedule, atomic
checkpoints and when to write them, RNG state and the process group.

Invariants: the schedule is a pure function of (step, progress); a checkpoint file is either the old
one or the complete new one (written to a temporary name, then renamed); RNG state round-trips exactly
(python, numpy, torch and, when present, CUDA), so a resumed run continues bit-identically; the process
group's backend follows the device the tensors live on (gloo for CPU, nccl for CUDA), never merely
whether CUDA exists.  Used by the demo target's trainer (`lab/demo_target/train.py`) and the drafter
trainer (:mod:`peagle.train.loop`).
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from .. import device as peagle_device


def resolve_device(name: str = "auto") -> torch.device:
    """:func:`peagle.device.resolve_device`; under torchrun a bare ``cuda`` is this rank's GPU (LOCAL_RANK)."""
    dev = peagle_device.resolve_device(name)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return dev


def tune_malloc() -> None:
    """Keep freed memory in the glibc heap: otherwise each step's large activation buffers go back to
    the OS and page-fault back in (measured 3-4x slower steps on the 2-vCPU VM)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 2 ** 31 - 1)  # M_TRIM_THRESHOLD
        libc.mallopt(-2, 1 << 30)      # M_TOP_PAD
        libc.mallopt(-3, 1 << 25)      # M_MMAP_THRESHOLD (glibc max: 32 MiB)
    except (OSError, AttributeError):
        pass


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision on the tensors' own device (no-op for fp32)."""
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def lr_factor(step: int, progress: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio`` as ``progress``
    (fraction of the run done, by steps or by time) goes from the end of warm-up to 1."""
    if step < warmup:
        return min(1.0, (step + 1) / max(1, warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def cosine_progress(step: int, total: int, warmup: int) -> float:
    return (step - warmup) / max(1, total - warmup)


# ------------------------------------------------------------------------------------ checkpoints
class CheckpointClock:
    """When a trainer writes its checkpoint: every ``steps`` optimizer steps and/or every ``minutes`` of wall
    time since the last one (0 steps / None minutes: never by that measure)."""

    def __init__(self, steps: int = 0, minutes: float | None = None):
        self.steps, self.seconds = steps, (None if minutes is None else minutes * 60)
        self.restart()

    def restart(self) -> None:
        """A checkpoint was just written: the wall-time measure starts again."""
        self.last = time.time()

    def due(self, step: int) -> bool:
        if self.steps and step % self.steps == 0:
            return True
        return self.seconds is not None and time.time() - self.last >= self.seconds


def save_checkpoint(path: str | Path, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict | None:
    path = Path(path)
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    if "numpy" in st:
        np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------ processes
def dist_setup(device: torch.device) -> tuple[int, int]:
    """(rank, world size); under torchrun, joins the process group on the backend of ``device``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def all_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


def broadcast(t: torch.Tensor, world: int) -> torch.Tensor:
    """Rank 0's value everywhere (e.g. the clock or a stop flag, so every rank agrees)."""
    if world > 1:
        import torch.distributed as dist

        dist.broadcast(t, 0)
    return t


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
