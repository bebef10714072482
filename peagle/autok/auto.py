"""`"num_speculative_tokens": "auto"`: each step, the K in 0..k_max with the most expected output tokens per
second for the batch: argmax_K  sum_rows E[accepted + 1 | K] / t_step(B, K).

E comes from the live acceptance (acceptance.py), t_step from the measured cost model (costmodel.py); after
each step both learn from what happened (acceptance counts, the step's wall time). K = 0 wins when no K > 0
is expected to beat plain decoding by `margin`, so speculation is expected never to cost. Deterministic given its inputs:
the choice depends only on earlier steps."""
from __future__ import annotations

from .acceptance import Acceptance
from .costmodel import CostModel
from .policy import KPolicy


class AutoK(KPolicy):
    mode = "auto"

    def __init__(self, k_max: int, cost: CostModel, acceptance: Acceptance, refine: bool = True,
                 margin: float = 0.02):
        """margin: a K > 0 must beat plain decoding (K = 0) by this fraction to be chosen."""
        if cost.k_max < k_max or acceptance.k_max < k_max:
            raise ValueError(f"the cost model and acceptance estimate must cover K up to {k_max}")
        super().__init__(k_max)
        self.cost, self.acc, self.refine, self.margin = cost, acceptance, refine, margin
        self.last: dict = {}

    def rates(self, rids) -> tuple:
        """(expected tokens [k_max+1], seconds per step [k_max+1], tokens per second [k_max+1]) for a batch."""
        tokens = self.acc.expected_tokens(rids)
        secs = self.cost.predict(len(rids))[: self.k_max + 1]
        return tokens, secs, tokens / secs

    def choose(self, rows) -> int:
        rids = [r.request_id for r in rows]
        tokens, secs, rate = self.rates(rids)
        k = int(rate.argmax())
        if k and rate[k] < rate[0] * (1 + self.margin):
            k = 0
        self.last = {"batch_size": len(rids), "k": k, "expected_tokens": tokens, "step_time_s": secs,
                     "tokens_per_s": rate}
        return k

    def drafts_next(self, batch_size: int) -> bool:
        return self.last.get("k", 1) > 0             # as the last step chose (before any: yes)

    def observe(self, rows, k, accepted, step_s):
        self.acc.observe([r.request_id for r in rows], k, accepted)
        if self.refine:
            self.cost.update(len(rows), k, step_s)

    def describe(self) -> dict:
        d = {**super().describe(), **self.acc.summary(), "cost_model_updates": self.cost.updates,
             "cost_model": self.cost.meta.get("path")}
        for key, v in self.last.items():
            d[key] = [round(float(x), 6) for x in v] if hasattr(v, "tolist") else v
        return d
