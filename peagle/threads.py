"""How many threads a CPU step runs on while other processes share the CPUs.

Invariant: the thread count changes only the time. Every op of a step splits over independent outputs and
computes each output the same way whichever thread runs it (the kernels' products, attention, norms; torch's
few ops of a step likewise), so a step gives the same bits on any thread count (tests/test_threads.py) and the
count may follow the machine's load between steps.

Why: a step is a few hundred OpenMP parallel regions, each ending at a barrier. When another process takes a
share of a core, the thread it displaces holds every barrier it misses for a scheduler slice, and the step slows
several-fold; one thread fewer leaves the other process a core and the step runs at one-thread speed. Measured
(lab/measure/shared_cpu.py, docs/benchmarks/shared-cpu.md): on 2 cores a busy process beside SmolLM2's q4a8
decoding took it from ~270 tok/s to ~60-70 on 2 threads, against ~190-200 on 1 (2-core AMD EPYC, Zen 4).

ThreadGovernor.tick() before each engine step and rest(shape) after it: every WINDOW seconds of back-to-back
steps it reads how long the CPUs this process may run on were busy (/proc/stat) minus this process's own CPU
time -- what other processes took. Below QUIET of a core taken from the cores it would use, it steps on all its
threads; from BUSY on, on as many fewer as the others take (choose). In between, the load alone does not say
which is faster -- 1 thread won beside a process busy half the time in a decoding loop, 2 threads won beside the
benchmark's own streaming client at 16 requests -- so the governor measures: a window on each of the two counts,
then the one whose steps of the shapes both ran (rows, K, tree) took less time, the other measured again after PROBE
seconds (twice as long each time it loses again, up to 8 PROBE: a probe on the slower count costs a window).
Off where there is no /proc/stat or with PEAGLE_THREADS=fixed. If the caller changes torch's thread count
itself, the governor takes the new count as its ceiling."""
from __future__ import annotations

import math
import os
import sys
import time

import torch

WINDOW = 0.25        # seconds between readings
QUIET = 0.2          # others' load (CPUs) on this process's cores below which it uses them all
BUSY = 0.75          # ... from which it gives up as many cores as they take (a core busy half the time: between)
PROBE = 3.0          # between the two: seconds after which the count not in use is measured again
IDLE = 0.05          # a pause between steps longer than this starts a new window
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def choose(others: float, cores: int, ceiling: int) -> int | None:
    """The thread count others' load settles (e: what they take of the `ceiling` cores this process would use),
    or None where measuring is to settle it, between `ceiling` and one fewer."""
    e = others - (cores - ceiling)
    if ceiling == 1 or e < QUIET:
        return ceiling
    if e >= BUSY:
        return max(1, ceiling - math.ceil(e - QUIET))
    return None


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


def _sample(cpus: set[int]):
    """(monotonic s, busy CPU-s of `cpus`, this process's CPU-s), or None where /proc/stat cannot be read."""
    b = busy_seconds(cpus)
    return None if b is None else (time.monotonic(), b, time.process_time())


def _others(s0, s1) -> float:
    """CPUs other processes kept busy between two samples: the busy time less this process's own, per second."""
    (t0, b0, p0), (t1, b1, p1) = s0, s1
    return max(0.0, (b1 - b0) - (p1 - p0)) / (t1 - t0)


def others_busy(window: float, cpus: set[int] | None = None) -> float | None:
    """CPUs that other processes kept busy over the next `window` seconds (busy time less this process's own),
    on `cpus` (default: those this process may run on); None where /proc/stat cannot be read."""
    cpus = cpus if cpus is not None else _cpus()
    s0 = _sample(cpus)
    time.sleep(window)
    s1 = _sample(cpus)
    return None if s0 is None or s1 is None else _others(s0, s1)


def _cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


class ThreadGovernor:
    def __init__(self, log=None):
        self.cpus = _cpus()
        self.ceiling = self.threads = torch.get_num_threads()
        self.switches = 0
        self.seen: dict[int, tuple[dict, float]] = {}   # between QUIET and BUSY: count -> (its window's steps, when)
        self.every: dict[int, float] = {}    # count -> seconds before it is measured again (PROBE, doubled each loss)
        self.log = log if log is not None else (lambda s: print(s, file=sys.stderr, flush=True))
        self._said = False
        self._last = None                    # the window's first reading: (monotonic s, busy CPU-s, own CPU-s)
        self._steps: dict = {}               # the window's steps: shape -> (seconds, count)
        self._started = None                 # when the running step started
        self._rested = None                  # when the last step ended
        self.on = os.environ.get("PEAGLE_THREADS", "adapt") != "fixed" and busy_seconds(self.cpus) is not None

    def tick(self) -> int:
        """Called before each step; returns the thread count the step runs on."""
        self._started = None
        if not self.on:
            self._last = None                  # a window spans governed steps only
            return self.threads
        if torch.get_num_threads() != self.threads:          # the caller set a count: it is the new ceiling
            self.ceiling = self.threads = torch.get_num_threads()
            self.seen.clear()
        now = time.monotonic()
        if self._rested is not None and now - self._rested > IDLE:
            self._last = None                  # what others ran while no step did says nothing of contention
        self._rested = None
        if self._last is None:
            self._last, self._steps = _sample(self.cpus), {}
        elif now - self._last[0] >= WINDOW:
            self._close()
        self._started = time.monotonic()
        return self.threads

    def _close(self):
        cur = _sample(self.cpus)
        if cur is None:
            self.on = False
            return
        others, t1 = _others(self._last, cur), cur[0]
        self._last, steps, self._steps = cur, self._steps, {}
        n = choose(others, len(self.cpus), self.ceiling)
        if n is None:
            n = self.measure(steps, t1)
        else:                              # the band compares them too: a client that slows with this process
            self.seen[self.threads] = (steps, t1)        # reads quiet beside its smaller count
        if n != self.threads:
            if not self._said:
                self.log(f"peagle: other processes keep {others:.1f} of the {len(self.cpus)} CPUs this one runs on "
                         f"busy: stepping on {n} of {self.ceiling} threads while that is faster "
                         f"(PEAGLE_THREADS=fixed keeps {self.ceiling})")
                self._said = True
            torch.set_num_threads(n)
            self.threads, self.switches = n, self.switches + 1

    def measure(self, steps: dict, now: float) -> int:
        """Between QUIET and BUSY: `steps` (shape -> (seconds, count)) ran in the window just ended on the current
        count. The next count: the other of the pair (ceiling, one fewer) where it was not measured in its last
        `every` s (PROBE at first) or ran none of these shapes, else the one whose steps of the shapes both ran
        cost less. Quiet and busy windows record their steps too."""
        self.seen[self.threads] = (steps, now)
        hi, lo = self.ceiling, self.ceiling - 1
        for n in (lo, hi) if self.threads == hi else (hi, lo):       # the other count first
            if n not in self.seen or now - self.seen[n][1] > self.every.get(n, PROBE):
                return n
        a, b = self.seen[hi][0], self.seen[lo][0]
        common = a.keys() & b.keys()
        if not common:
            return lo if self.threads == hi else hi
        cost = lambda st: sum((a[s][1] + b[s][1]) * st[s][0] / st[s][1] for s in common)
        best = hi if cost(a) <= cost(b) else lo
        # a count that keeps losing is measured ever less often (up to 8 PROBE); one that wins, every PROBE
        self.every[self.threads] = PROBE if best == self.threads else min(8 * PROBE, 2 * self.every.get(
            self.threads, PROBE))
        return best

    def rest(self, shape=None):
        """Called after each step with its shape (None: not to be compared, e.g. a prefill): a window spans only
        steps run back to back."""
        self._rested = time.monotonic()
        if shape is not None and self._started is not None and self.on:
            t, n = self._steps.get(shape, (0.0, 0))
            self._steps[shape] = (t + self._rested - self._started, n + 1)
