"""How many tokens to draft this step: the engine asks a K policy once per decode step, for the whole batch.

Invariant: `choose(rows)` returns one K in 0..k_max for every running row, decided only from what happened
before this step (never from this step's random draws), so switching K between steps keeps greedy outputs
identical and sampling exact; K = 0 is a plain decoding step (the drafter is not run; its cache catches up on
the next step with K > 0). After the step the engine reports it through `observe`.

Policies: FixedK (a static num_speculative_tokens), BatchSizeSchedule (vLLM's
num_speculative_tokens_per_batch_size), AutoK (peagle.autok.auto: the K with the most expected tokens per
second)."""
from __future__ import annotations


class KPolicy:
    mode = "base"

    def __init__(self, k_max: int):
        self.k_max = int(k_max)

    def choose(self, rows) -> int:
        """rows: the engine's running Request objects (the batch of this step)."""
        raise NotImplementedError

    def observe(self, rows, k: int, accepted, step_s: float) -> None:
        """After a decode step: K used, accepted drafts per row (tensor [B]; zeros when K = 0) and the step's
        wall time in seconds (drafting + verification + bookkeeping)."""

    def describe(self) -> dict:
        return {"mode": self.mode, "k_max": self.k_max}


class FixedK(KPolicy):
    mode = "fixed"

    def choose(self, rows) -> int:
        return self.k_max
