"""t_step(B, K): the seconds one decode step takes with B running requests drafting K tokens each (drafting +
verification + bookkeeping; K = 0 is a plain decoding step).

A grid of measured times (batch sizes x K = 0..k_max, see measure.py), made nondecreasing in K and in B
(drafting more, or for more rows, never costs less: `monotone`), is interpolated linearly in B between grid
points and extrapolated linearly beyond the largest (never below the largest grid point's time), then
multiplied by one machine-wide `scale`. Online refinement, in log space, the error clipped to +-0.5 (one slow
step caused by something else cannot swing the model): the scale follows every step (`scale_rate`: the whole
machine got slower or faster, all K alike), and the grid cells the step was interpolated from follow what is
left (`rate` x interpolation weight: this K at this batch size costs more or less than measured). Every cell
also relaxes toward its measured value (`relax` of its log-distance per update), so a K priced out by a stretch
of costly steps (long contexts) is tried again once they are over. Stored as JSON in the cache directory, one file
per machine/model/head/settings (`cache_key`)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform

import numpy as np
import torch

from ..device import cpuinfo
from ..paths import USER_CACHE

FORMAT = 2      # 2: meta carries the measured drafter_row_s


def cache_dir() -> str:
    """$PEAGLE_CACHE_DIR, else $XDG_CACHE_HOME/peagle, else ~/.cache/peagle (paths.USER_CACHE)."""
    return os.environ.get("PEAGLE_CACHE_DIR") or USER_CACHE


def shown_path(path: str | None) -> str | None:
    """A cache file's path as reports show it: under the home directory as ~/... (no user's home in reports)."""
    if not path:
        return path
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + os.sep) else path


def _cpu_name() -> str:
    name = cpuinfo("model name")
    return (platform.processor() or platform.machine()) if name is None else name


def _files_id(d: str) -> dict:
    """A model's identity for the cache: a directory's config text and its weight files' sizes and times; a
    file's (a .gguf) size and time."""
    out = {"config": ""}
    if os.path.isfile(d):
        st = os.stat(d)
        return {"file": os.path.basename(d), "size": st.st_size, "mtime": int(st.st_mtime)}
    try:
        with open(os.path.join(d, "config.json")) as f:
            out["config"] = hashlib.sha1(f.read().encode()).hexdigest()
        for fn in sorted(os.listdir(d)):
            if fn.endswith((".safetensors", ".bin")):
                st = os.stat(os.path.join(d, fn))
                out[fn] = [st.st_size, int(st.st_mtime)]
    except OSError:
        pass
    return out


# the code a step runs (the C++ kernels of csrc/ included): a change there (a faster kernel path) makes measured
# step times stale
STEP_CODE = ("models", "heads", "drafters", "csrc", "engine.py", "verify.py", "cache.py", "rowstate.py",
             "sampling.py", "tree.py", "tree_step.py")


def _code_id() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha1()
    for name in STEP_CODE:
        p = os.path.join(root, name)
        files = ([os.path.join(p, f) for f in sorted(os.listdir(p)) if f.endswith((".py", ".cpp", ".h"))]
                 if os.path.isdir(p) else [p])
        for fn in files:
            with open(fn, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def cache_key(model_dir: str, head_dir: str, method: str, dtype, settings: dict) -> tuple[str, dict]:
    """-> (file name, what it identifies): the machine, torch and its thread count, peagle's step code, the
    model and the head (by content, not path), the drafting method, dtype and the measurement settings."""
    ident = {"format": FORMAT, "cpu": _cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
             "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
             "torch": torch.__version__, "code": _code_id(),
             "model": _files_id(model_dir), "head": _files_id(head_dir),
             "method": method, "dtype": str(dtype), **settings}
    h = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return f"costs-{method}-{h}.json", ident


class CostModel:
    def __init__(self, batch_sizes: list, times: list, rate: float = 0.05, scale_rate: float = 0.05,
                 meta: dict | None = None, relax: float = 0.01):
        """times[i][k]: seconds per step at batch_sizes[i] (ascending) with K = k.  relax: per update, every
        cell's log-distance from its measured value shrinks by this fraction (half-life ~70 updates), so a
        cell raised by a stretch of costly steps (long contexts) is tried again once they are over."""
        if not batch_sizes or len(times) != len(batch_sizes):
            raise ValueError("a cost model needs one row of times per batch size")
        self.bs = [int(b) for b in batch_sizes]
        self.t = np.maximum(np.asarray(times, dtype=np.float64), 1e-6)        # [G, k_max + 1]
        self.t0 = self.t.copy()                                                # as measured
        self.rate, self.scale_rate, self.meta, self.relax = rate, scale_rate, dict(meta or {}), relax
        self.scale, self.updates = 1.0, 0

    @property
    def k_max(self) -> int:
        return self.t.shape[1] - 1

    def _weights(self, B: int) -> list:
        """[(grid index, weight)] of B's linear interpolation (or extrapolation past the ends)."""
        bs = self.bs
        if len(bs) == 1 or B <= bs[0]:
            return [(0, 1.0)]
        i = next((j for j in range(1, len(bs)) if B <= bs[j]), len(bs) - 1)
        w = (B - bs[i - 1]) / (bs[i] - bs[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def predict(self, B: int, measured: bool = False) -> np.ndarray:
        """[k_max + 1]: seconds per step at batch size B for each K (measured: the grid as measured, without
        the online refinement)."""
        t = self.t0 if measured else self.t
        out = sum(w * t[i] for i, w in self._weights(B))
        if B > self.bs[-1]:
            out = np.maximum(out, t[-1])
        return out if measured else self.scale * out

    def price(self, B: int, positions: int) -> float:
        """Seconds per step at batch size B verifying `positions` positions per row: a chain of K drafts verifies
        K + 1, a token tree (peagle/tree.py) its nodes + 1. The K axis is read as positions - 1, past k_max
        linearly from its last step (never cheaper than k_max's)."""
        t = self.predict(B)
        k = max(int(positions) - 1, 0)
        if k <= self.k_max:
            return float(t[k])
        slope = float(t[-1] - t[-2]) if self.k_max >= 1 else 0.0
        return float(t[-1]) + max(slope, 0.0) * (k - self.k_max)

    def tree_or_chain(self, B: int, chain: tuple, tree: tuple) -> str:
        """"tree" or "chain", whichever yields more tokens per second at batch size B; chain / tree: (expected
        tokens per step, positions verified per step), e.g. from the metrics' mean_acceptance_length and
        mean_tree_nodes_per_step + 1 of runs of each."""
        rate = {n: e / self.price(B, pos) for n, (e, pos) in (("chain", chain), ("tree", tree))}
        return "tree" if rate["tree"] > rate["chain"] else "chain"

    def update(self, B: int, k: int, seconds: float):
        if seconds <= 0 or not 0 <= k <= self.k_max:
            return

        gap = math.log(seconds) - math.log(float(self.predict(B)[k]))
        e1 = max(-0.5, min(0.5, gap))
        self.scale *= math.exp(self.scale_rate * e1)
        e = max(-0.5, min(0.5, gap - self.scale_rate * e1))          # what the new scale leaves
        ws = self._weights(B)
        if B > self.bs[-1]:
            ws = [(len(self.bs) - 1, 1.0)]
        if self.relax:
            self.t = self.t0 * (self.t / self.t0) ** (1.0 - self.relax)
        for i, w in ws:
            self.t[i, k] *= math.exp(self.rate * w * e)
        self.updates += 1

    def monotone(self) -> "CostModel":
        """Make the grid nondecreasing in K (least-squares isotonic fit per batch size) and in B."""
        for i in range(self.t.shape[0]):
            self.t[i] = _isotonic(self.t[i].tolist())
        self.t = np.maximum.accumulate(self.t, axis=0)
        self.t0 = self.t.copy()
        return self

    def copy(self) -> "CostModel":
        c = CostModel(self.bs, self.t.tolist(), self.rate, self.scale_rate, self.meta, self.relax)
        c.t0, c.scale = self.t0.copy(), self.scale
        return c

    # ------------------------------------------------------------------ storage
    def to_json(self) -> dict:
        return {"format": FORMAT, "batch_sizes": self.bs, "k": list(range(self.k_max + 1)),
                "seconds_per_step": [[round(float(x), 7) for x in row] for row in self.t], **self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        """ValueError unless d is a cost model of this format: ascending positive batch sizes, one row of finite
        positive seconds per batch size, every row as long."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a cost model of format {FORMAT}")
        bs, t = d.get("batch_sizes"), d.get("seconds_per_step")
        if not (isinstance(bs, list) and bs and all(isinstance(b, int) and b > 0 for b in bs) and bs == sorted(set(bs))):
            raise ValueError(f"batch_sizes must be ascending positive integers, got {bs!r}")
        if not (isinstance(t, list) and len(t) == len(bs) and all(isinstance(r, list) and r and len(r) == len(t[0])
                                                                   for r in t)):
            raise ValueError("seconds_per_step must hold one row per batch size, every row as long")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for r in t for x in r):
            raise ValueError("seconds_per_step must be finite positive numbers")
        meta = {k: v for k, v in d.items() if k not in ("format", "batch_sizes", "k", "seconds_per_step")}
        return cls(bs, t, meta=meta)

    def save(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "CostModel | None":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def covers(self, k_max: int, max_batch: int) -> bool:
        return self.k_max >= k_max and self.bs[-1] >= max_batch


def _isotonic(y: list) -> list:
    """The nondecreasing sequence closest to y in least squares (pool adjacent violators)."""
    blocks = []                                    # [sum, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]
