"""`"num_speculative_tokens": "auto"`: each step, the K in 0..k_max with the most expected output tokens per
second for the batch: argmax_K  sum_rows E[accepted + 1 | K] / t_step(B, K).

E comes from the live acceptance (acceptance.py), t_step from the measured cost model (costmodel.py); after
each step both learn from what happened (acceptance counts, the step's wall time). K = 0 wins when no K > 0
is expected to beat plain decoding by `margin`, so speculation is expected never to cost. Deterministic given its inputs:
the choice depends only on earlier steps.

Catch-up: after steps with K = 0 the drafter is behind (each row's skipped tokens, and the prompts of requests
admitted meanwhile, wait as drafter rows), and the first step with K > 0 feeds them all in one padded block of
B x max(rows) -- a one-off cost the cost model (measured in steady state) does not hold. For K > 0 that cost,
(padded rows beyond a steady step's k_max + 1) x seconds per drafter row, is added to t_step amortised over the
steps it pays for: the batch's remaining tokens per row (max_tokens minus generated) divided by the tokens per
row that K yields, capped at `horizon`. Seconds per drafter row start from the cost model (a K = 1 step's extra
time per row) and are learned from catch-up steps (their time beyond the steady prediction); those steps do not
refine the cost model."""
from __future__ import annotations

import numpy as np

from .acceptance import Acceptance
from .costmodel import CostModel, shown_path
from .policy import KPolicy


class AutoK(KPolicy):
    mode = "auto"

    def __init__(self, k_max: int, cost: CostModel, acceptance: Acceptance, refine: bool = True,
                 margin: float = 0.02, horizon: int = 64, default_max_tokens: int = 256):
        """margin: a K > 0 must beat plain decoding (K = 0) by this fraction to be chosen; horizon: the most
        steps a catch-up is amortised over; default_max_tokens: a request's budget when it sets none."""
        if cost.k_max < k_max or acceptance.k_max < k_max:
            raise ValueError(f"the cost model and acceptance estimate must cover K up to {k_max}")
        super().__init__(k_max)
        self.cost, self.acc, self.refine, self.margin = cost, acceptance, refine, margin
        self.horizon, self.default_max_tokens = horizon, default_max_tokens
        big = cost.t[-1]
        self.row_s = max(float(big[min(1, cost.k_max)] - big[0]), 0.0) / (2 * cost.bs[-1])  # prior, then learned
        self.row_s_learned = False
        self.last: dict = {}

    def rates(self, rids) -> tuple:
        """(expected tokens [k_max+1], seconds per step [k_max+1], tokens per second [k_max+1]) for a batch."""
        tokens = self.acc.expected_tokens(rids)
        secs = self.cost.predict(len(rids))[: self.k_max + 1]
        return tokens, secs, tokens / secs

    def _best(self, rate) -> int:
        """The K with the most tokens per second; a K > 0 must beat K = 0 by the margin."""
        k = int(rate.argmax())
        return 0 if k and rate[k] < rate[0] * (1 + self.margin) else k

    def catch_up_rows(self, rows) -> int:
        """Padded drafter rows the next K > 0 step feeds beyond a steady step's (B x (k_max + 1))."""
        n = max((getattr(r, "draft_rows", 0) for r in rows), default=0)
        return len(rows) * max(0, n - (self.k_max + 1))

    def remaining_tokens(self, rows) -> float:
        """Mean tokens each row may still generate."""
        left = [max(1, ((getattr(r, "params", None) and r.params.max_tokens) or self.default_max_tokens)
                    - len(getattr(r, "output_ids", ()))) for r in rows]
        return sum(left) / max(1, len(left))

    def choose(self, rows) -> int:
        rids = [r.request_id for r in rows]
        tokens, secs, rate = self.rates(rids)
        extra = self.catch_up_rows(rows)
        if extra:
            per_row = tokens / max(1, len(rids))                       # tokens per row per step, by K
            steps = np.clip(self.remaining_tokens(rows) / per_row, 1, self.horizon)
            catch = extra * self.row_s / steps
            catch[0] = 0.0                                             # K = 0 feeds the drafter nothing
            secs = secs + catch
            rate = tokens / secs
        k = self._best(rate)
        self.last = {"batch_size": len(rids), "k": k, "expected_tokens": tokens, "step_time_s": secs,
                     "tokens_per_s": rate, "catch_up_rows": extra, "drafter_row_s": self.row_s}
        return k

    def drafts_next(self, batch_size: int) -> bool:
        """Would a step of this many rows (the batch after admission), with the drafter caught up, draft? A
        prompt admitted when not gets no drafter prefill (it joins the catch-up), so a batch that will decode
        with K = 0 (large batches) never pays for drafter context it does not use."""
        return self._best(self.rates([None] * batch_size)[2]) > 0     # anonymous rows: the global estimate

    def observe(self, rows, k, accepted, step_s):
        self.acc.observe([r.request_id for r in rows], k, accepted)
        extra = self.last.get("catch_up_rows", 0) if self.last.get("batch_size") == len(rows) else 0
        if k and extra:       # a catch-up step: learn seconds per drafter row from its time beyond steady state
            sample = max(0.0, step_s - float(self.cost.predict(len(rows))[k])) / extra
            self.row_s = sample if not self.row_s_learned else 0.5 * self.row_s + 0.5 * sample
            self.row_s_learned = True
        elif self.refine:
            self.cost.update(len(rows), k, step_s)

    def describe(self) -> dict:
        d = {**super().describe(), **self.acc.summary(), "cost_model_updates": self.cost.updates,
             "cost_model": shown_path(self.cost.meta.get("path"))}
        for key, v in self.last.items():
            d[key] = [round(float(x), 6) for x in v] if hasattr(v, "tolist") else v
        return d
