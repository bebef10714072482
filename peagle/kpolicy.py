"""How many tokens to draft this step: the engine asks a K policy once per decode step, for the whole batch.

Invariant: `choose(rows)` returns one K in 0..k_max for every running row, decided only from what happened
before this step (never from this step's random draws), so switching K between steps keeps greedy outputs
identical and sampling exact; K = 0 is a plain decoding step (the drafter is not run; its cache catches up on
the next step with K > 0). After the step the engine reports it through `observe`.

The engine owns this protocol; policies plug into it from above. Here: FixedK (a static
num_speculative_tokens) and BatchSizeSchedule (vLLM's num_speculative_tokens_per_batch_size, with the
schedule's validation that peagle/spec_config.py uses). AutoK (peagle/autok/auto.py: the K with the most
expected tokens per second) and the measurement's ForcedK (peagle/autok/measure.py) implement it there."""
from __future__ import annotations


class KPolicy:
    mode = "base"
    proposer = None             # the engine's proposer (attach), for what a policy asks of the drafter

    def __init__(self, k_max: int):
        self.k_max = int(k_max)

    def attach(self, proposer) -> None:
        """The engine hands over its proposer (None: plain decoding); AutoK asks it what a catch-up costs."""
        self.proposer = proposer

    def choose(self, rows) -> int:
        """rows: the engine's running Request objects (the batch of this step)."""
        raise NotImplementedError

    def drafts_next(self, batch_size: int) -> bool:
        """Will the coming steps, with `batch_size` rows (running + admitted + waiting, at most max_num_seqs),
        draft (K > 0)? If not, the engine leaves new prompts to the drafter's catch-up instead of prefilling the
        drafter at admission."""
        return self.k_max > 0

    def wants_tree(self) -> bool:
        """Asked after choose() picked K > 0 in an engine with token trees: verify a tree (True) or the chain."""
        return True

    def observe(self, rows, k: int, accepted, step_s: float, tree: bool = False) -> None:
        """After a decode step: K used, accepted drafts per row (a list of B ints; zeros when K = 0), the step's
        wall time in seconds (drafting + verification + bookkeeping) and whether it verified a token tree."""

    def describe(self) -> dict:
        return {"mode": self.mode, "k_max": self.k_max}


class FixedK(KPolicy):
    mode = "fixed"

    def choose(self, rows) -> int:
        return self.k_max


def validate_schedule(schedule) -> list:
    """vLLM 0.32's `num_speculative_tokens_per_batch_size`: a non-empty list of [start, end, K] with inclusive,
    positive, non-overlapping batch-size ranges, the first starting at 1, K >= 0. Returns it sorted, as tuples;
    raises ValueError with the rule broken."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError("num_speculative_tokens_per_batch_size must be a non-empty list of "
                         "[range_start, range_end, num_speculative_tokens] entries")
    out = []
    for e in schedule:
        if not isinstance(e, (list, tuple)) or len(e) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in e):
            raise ValueError(f"each num_speculative_tokens_per_batch_size entry must be 3 integers "
                             f"[range_start, range_end, num_speculative_tokens], got {e!r}")
        s, t, k = e
        if s <= 0 or t <= 0 or s > t:
            raise ValueError(f"batch-size range ({s}, {t}) must be positive with start <= end")
        if k < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size values must be >= 0, got {k}")
        out.append((s, t, k))
    out.sort()
    for (_, t0, _), (s1, _, _) in zip(out, out[1:]):
        if s1 <= t0:
            raise ValueError("num_speculative_tokens_per_batch_size ranges must not overlap")
    if out[0][0] != 1:
        raise ValueError("the first batch-size range must start at 1 so every batch size has a K")
    return out


class BatchSizeSchedule(KPolicy):
    """K from the batch size, as vLLM reads the schedule: the entry whose range holds B; a B between ranges
    keeps the K of the range before it, a B past the last range the last K; always at most k_max."""
    mode = "schedule"

    def __init__(self, schedule, k_max: int):
        super().__init__(k_max)
        self.schedule = validate_schedule(schedule)

    def k_for(self, batch_size: int) -> int:
        k = 0
        for s, _, kk in self.schedule:
            if batch_size >= s:
                k = kk
        return min(k, self.k_max)

    def choose(self, rows) -> int:
        return self.k_for(len(rows))

    def drafts_next(self, batch_size: int) -> bool:
        return self.k_for(batch_size) > 0

    def describe(self) -> dict:
        return {**super().describe(), "schedule": [list(e) for e in self.schedule]}
