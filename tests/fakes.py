"""Test doubles for the engine: proposers without a drafter network, a scripted K policy, and how to put
them into an LLM's engine."""
from __future__ import annotations

from peagle.drafters.base import Proposer
from peagle.engine import cache_len
from peagle.kpolicy import FixedK, KPolicy
from peagle.spec_metrics import SpecMetrics


class FakeProposer(Proposer):
    """A proposer with no drafter head or cache (subclasses implement propose(batch, k))."""

    def __init__(self, k):
        self.k = k
        self.head = type("H", (), {"aux_ids": ()})()
        self.cache = type("C", (), {"ensure_rows": lambda s, n, limit=None: None, "move_row": lambda s, a, b: None})()

    def prefill(self, batch):
        pass


class ScriptedK(KPolicy):
    """K per decode step from a fixed cycle (deterministic: no timing); records what the engine reported."""
    mode = "scripted"

    def __init__(self, k_max, script):
        super().__init__(k_max)
        self.script, self.i = list(script), 0
        self.chosen, self.observed = [], []

    def choose(self, rows):
        k = self.script[self.i % len(self.script)]
        self.i += 1
        self.chosen.append(k)
        return k

    def drafts_next(self, batch_size):
        """Whether the next scripted K drafts (K = 0 next: new prompts wait for the drafter's catch-up)."""
        return self.script[self.i % len(self.script)] > 0

    def observe(self, rows, k, accepted, step_s, tree=False):
        self.observed.append((len(rows), k, list(accepted)))


def install_proposer(llm, proposer, k, policy=None):
    """Make llm's engine speculate with `proposer` (up to k tokens, K chosen by `policy`, default k)."""
    e = llm.engine
    e.proposer, e.k, e.aux_ids = proposer, k, proposer.head.aux_ids
    e.k_policy = policy or FixedK(k)
    e.k_policy.attach(proposer)
    e.metrics = SpecMetrics(k)
    e.metrics.extra = lambda: {"k_policy": e.k_policy.describe()}
    e.cache = e.target.new_cache(1, cache_len(e.max_model_len, k))
    return llm
