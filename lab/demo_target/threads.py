"""The demo target trainer's torch thread count: fixed, or re-picked by measured step time (on a 2-vCPU machine
shared with other jobs, 2 OpenMP threads can be several times slower than 1)."""
from __future__ import annotations

import os

import numpy as np


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
