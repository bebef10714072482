"""Live acceptance of the drafts, per draft position, smoothed: what a step with K drafts is expected to yield.

alpha_i = P(draft i accepted | drafts 1..i-1 accepted): a row whose step drafted K tokens and accepted a of
them is one trial of positions 1..min(a+1, K) and one success of positions 1..a. Then
E[accepted + 1 | K] = 1 + sum_{i<=K} prod_{j<=i} alpha_j, whatever K earlier steps used.

Invariants: estimates stay in (0, 1); evidence is forgotten exponentially per row-step (every running row of
every decode step, K = 0 included, ages it by one), so the estimate follows the traffic and a position no
longer drafted drifts back to its prior: the estimate of the position before it (times the prior's ratio
when the head's training accuracy per depth is known). That drift is what makes an unused depth (or K = 0)
worth trying again. Per request: its own counts, shrunk toward the global estimate (`request_weight`
pseudo-rows), kept only while the request is in the batch."""
from __future__ import annotations

import math

import numpy as np

DEFAULT_FIRST = 0.6          # alpha_1 before any evidence when the head carries no training accuracy


class Acceptance:
    """Small float64 numpy arrays (k_max <= 32, a batch of rows): per-step cost is microseconds."""

    def __init__(self, k_max: int, prior: list | None = None, prior_weight: float = 4.0,
                 half_life_rows: float = 4096.0, request_weight: float = 16.0, request_half_life: float = 128.0):
        self.k_max = int(k_max)
        p = [min(max(float(x), 0.05), 0.95) for x in (prior or [])[: self.k_max]]
        self.first = p[0] if p else DEFAULT_FIRST
        # deeper positions default to the estimate of the position before, scaled like the prior (never up)
        self.ratio = [1.0] + [min(p[j] / p[j - 1], 1.0) if j < len(p) else 1.0 for j in range(1, self.k_max)]
        self.w0, self.wr = prior_weight, request_weight
        self.decay = 0.5 ** (1.0 / half_life_rows)
        self.decay_r = 0.5 ** (1.0 / request_half_life)
        self._s = np.zeros(self.k_max)       # successes per position (global, aged but for `_aging` row-steps)
        self._t = np.zeros(self.k_max)       # trials per position
        self._aging = 0                      # row-steps of ageing not yet applied to _s and _t
        self.slots: dict[str, int] = {}     # request id -> row of rs / rt
        self._free: list[int] = []
        self.rs = np.zeros((0, self.k_max))
        self.rt = np.zeros((0, self.k_max))

    @property
    def s(self) -> np.ndarray:
        self._age_now()
        return self._s

    @property
    def t(self) -> np.ndarray:
        self._age_now()
        return self._t

    def _age_now(self):
        if self._aging:
            d = self.decay ** self._aging
            self._s *= d
            self._t *= d
            self._aging = 0

    def global_alpha(self) -> np.ndarray:
        a, prev = np.empty(self.k_max), self.first
        s, t = self.s.tolist(), self.t.tolist()
        for j in range(self.k_max):
            prior = self.first if j == 0 else prev * self.ratio[j]
            prev = a[j] = (s[j] + self.w0 * prior) / (t[j] + self.w0)
        return a

    def alphas(self, rids) -> np.ndarray:
        """[B, k_max]: each row's alpha (its own evidence shrunk toward the global estimate)."""
        g = self.global_alpha()
        idx = np.array([self.slots.get(r, -1) for r in rids], dtype=np.int64)
        known = idx >= 0
        out = np.broadcast_to(g, (len(rids), self.k_max)).copy()
        if known.any():
            sel = idx[known]
            out[known] = (self.rs[sel] + self.wr * g) / (self.rt[sel] + self.wr)
        return out

    def expected_tokens(self, rids) -> np.ndarray:
        """[k_max + 1]: sum over rows of E[accepted + 1 | K] for K = 0..k_max."""
        c = np.clip(self.alphas(rids), 1e-6, 1 - 1e-6).cumprod(1).sum(0)
        return np.concatenate([[0.0], c.cumsum()]) + len(rids)

    def age(self, rows: int):
        """Forget as much as `rows` row-steps without drafts do (what observe does for a K = 0 step, without
        its bookkeeping of which requests are in the batch: that waits for the next observe). Applied when the
        counts are next read (ageing is a product, so the order does not matter): a step without drafts costs an
        integer addition, not numpy calls right after the target's forward (docs/benchmarks/auto/README.md)."""
        self._aging += rows

    def observe(self, rids, k: int, accepted):
        """accepted: accepted drafts per row (any int sequence or tensor of length B)."""
        self.age(len(rids))
        self._keep(rids)
        if not k:
            return
        idx = np.array([self._slot(r) for r in rids], dtype=np.int64)
        a = np.asarray(accepted.tolist() if hasattr(accepted, "tolist") else accepted, dtype=np.int64)[:, None]
        pos = np.arange(k)[None]
        trial, succ = (pos <= a).astype(np.float64), (pos < a).astype(np.float64)       # [B, k]
        self.t[:k] += trial.sum(0)
        self.s[:k] += succ.sum(0)
        self.rt[idx] *= self.decay_r
        self.rs[idx] *= self.decay_r
        self.rt[idx, :k] += trial
        self.rs[idx, :k] += succ

    def _keep(self, rids):
        """Forget requests that left the batch (their slots are reused)."""
        live = set(rids)
        for r in [r for r in self.slots if r not in live]:
            i = self.slots.pop(r)
            self.rs[i] = 0
            self.rt[i] = 0
            self._free.append(i)

    def _slot(self, rid) -> int:
        i = self.slots.get(rid)
        if i is None:
            if not self._free:
                n = self.rs.shape[0]
                grow = max(8, n)
                self.rs = np.concatenate([self.rs, np.zeros((grow, self.k_max))])
                self.rt = np.concatenate([self.rt, np.zeros((grow, self.k_max))])
                self._free.extend(range(n + grow - 1, n - 1, -1))
            i = self.slots[rid] = self._free.pop()
        return i

    def summary(self) -> dict:
        return {"alpha_per_pos": [round(float(x), 4) for x in self.global_alpha()],
                "evidence_rows_per_pos": [round(float(x), 1) for x in self.t],
                "half_life_rows": round(math.log(0.5) / math.log(self.decay), 1)}
