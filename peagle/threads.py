"""How many threads a CPU step runs on while other processes share the CPUs.

Invariant: the thread count changes only the time. Every op of a step splits over independent outputs and
computes each output the same way whichever thread runs it (the kernels' products, attention, norms; torch's
few ops of a step likewise), so a step gives the same bits on any thread count (tests/test_threads.py) and the
count may follow the machine's load between steps.

Why: a step is a few hundred OpenMP parallel regions, each ending at a barrier. When another process takes a
share of a core, the thread it displaces holds every barrier it misses for a scheduler slice, and the step slows
several-fold; one thread fewer leaves the other process a core and the step runs at one-thread speed. Measured
(lab/measure/shared_cpu.py, docs/benchmarks/shared-cpu.md): on 2 cores a busy process beside SmolLM2's q4a8
decoding took it from ~250 tok/s to ~45-90 on 2 threads, against ~180 on 1.

ThreadGovernor.tick(), once per engine step: every WINDOW seconds it reads how long the CPUs this process may run
on were busy (/proc/stat) minus this process's own CPU time -- what other processes took -- and steps on
cores - ceil(others - DOWN) threads (at least 1, at most the count it started from), coming back up only when
others fall below UP (hysteresis: a fluctuating load does not flip the count every window). Off where there is
no /proc/stat, on one thread, or with PEAGLE_THREADS=fixed. If the caller changes torch's thread count itself,
the governor takes the new count as its ceiling."""
from __future__ import annotations

import math
import os
import sys
import time

import torch

WINDOW = 0.25        # seconds between readings
DOWN = 0.35          # others' CPUs above which a thread is given up (measured: 0.25 of a core costs nothing)
UP = 0.2             # ... and below which it is taken back
IDLE = 0.05          # a pause between steps longer than this starts a new window
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def choose(current: int, others: float, cores: int, ceiling: int) -> int:
    """The thread count for the next window: fewer as soon as others' load passes DOWN for a core, more only
    once it is below UP for it."""
    down = cores - math.ceil(others - DOWN)
    up = cores - math.ceil(others - UP)
    if down < current:
        return max(1, down)
    if up > current:
        return min(ceiling, up)
    return current


def busy_seconds(cpus: set[int]) -> float | None:
    """CPU-seconds the given CPUs have been busy since boot (user, nice, system, irq, softirq; not idle, iowait
    or a VM's stolen time), from /proc/stat; None where it cannot be read."""
    total, seen = 0, 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line[3] == " ":
                    continue
                name, *v = line.split()
                if int(name[3:]) in cpus:
                    total += sum(int(x) for x in v[:3]) + int(v[5]) + int(v[6])
                    seen += 1
    except (OSError, ValueError, IndexError):
        return None
    return total / _TICK if seen == len(cpus) else None


class ThreadGovernor:
    def __init__(self, log=None):
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.ceiling = self.threads = torch.get_num_threads()
        self.switches = 0
        self.log = log if log is not None else (lambda s: print(s, file=sys.stderr, flush=True))
        self._said = False
        self._last = None                    # the window's first reading: (monotonic s, busy CPU-s, own CPU-s)
        self._rested = None                  # when the last step ended
        self.on = os.environ.get("PEAGLE_THREADS", "adapt") != "fixed" and busy_seconds(self.cpus) is not None

    def _sample(self):
        b = busy_seconds(self.cpus)
        return None if b is None else (time.monotonic(), b, time.process_time())

    def tick(self) -> int:
        """Called before each step; returns the thread count the step runs on."""
        if not self.on:
            self._last = None                  # a window spans governed steps only
            return self.threads
        if torch.get_num_threads() != self.threads:          # the caller set a count: it is the new ceiling
            self.ceiling = self.threads = torch.get_num_threads()
        now = time.monotonic()
        if self._rested is not None and now - self._rested > IDLE:
            self._last = None                  # what others ran while no step did says nothing of contention
        self._rested = None
        if self._last is None:
            self._last = self._sample()
            return self.threads
        t0, b0, p0 = self._last
        if now - t0 < WINDOW:
            return self.threads
        cur = self._sample()
        if cur is None:
            self.on = False
            return self.threads
        t1, b1, p1 = self._last = cur
        others = max(0.0, (b1 - b0) - (p1 - p0)) / (t1 - t0)
        n = choose(self.threads, others, len(self.cpus), self.ceiling)
        if n != self.threads:
            if not self._said:
                self.log(f"peagle: other processes keep {others:.1f} of the {len(self.cpus)} CPUs this one runs on "
                         f"busy: stepping on {n} of {self.ceiling} threads while they do (PEAGLE_THREADS=fixed keeps "
                         f"{self.ceiling})")
                self._said = True
            torch.set_num_threads(n)
            self.threads, self.switches = n, self.switches + 1
        return self.threads

    def rest(self):
        """Called after each step: a window spans only time in which steps ran back to back."""
        self._rested = time.monotonic()
