"""Tree or chain, per step: what auto K adds when the engine has token trees (peagle/tree.py).

A tree step of depth K verifies more positions than a chain step of the same K (its nodes + 1, and EAGLE-3
drafts one pass per level), so it costs more and must accept more to pay. Auto K prices both: the chain from its
own cost model and acceptance (auto.py), the tree from a cost model measured on tree steps and an acceptance
estimate learned from tree steps only (the same per-depth bookkeeping, acceptance.py: a tree step that accepted a
nodes along its path is one trial of depths 1..a+1 and one success of depths 1..a). Per K the faster of the two
stands for that K; the K (or plain decoding) is then chosen as without trees.

Invariant: the choice depends only on earlier steps (never on this step's draws), so switching between tree and
chain keeps greedy outputs identical and sampled ones exact (a tree's sampled rows: tree.accept_sampled).

Exploration: a tree's acceptance cannot be known before trees are verified, and an estimate that starts at the
chain's prior would never pick the costlier tree. So while the tree's evidence at depth 1 is below `low` rows,
steps with K > 0 verify a tree until `high` rows are in; evidence ages with every row-step (tree or not), so a
tree left unused is tried again after about two half-lives (acceptance.py's half_life_rows). Exploring is paid
for, so it is bounded: a step verifies a tree to learn only where that tree could beat the chosen chain if every
draft were accepted (K + 1 tokens per row), and while the forced tree steps' predicted seconds beyond their
chains' stay within `budget` of all decode steps' seconds so far (a 16 x 32 tree priced at 6x a plain step was
otherwise forced on its first 64 speculative steps: 0.81x plain decoding in a short MT-Bench run)."""
from __future__ import annotations

from .acceptance import Acceptance
from .costmodel import CostModel

EXPLORE_LOW, EXPLORE_HIGH = 16.0, 64.0     # rows of depth-1 evidence: start / stop trying trees
EXPLORE_BUDGET = 0.05                      # forced tree steps' extra seconds: at most this share of all steps'


class TreeChoice:
    def __init__(self, cost: CostModel, acceptance: Acceptance, low: float = EXPLORE_LOW,
                 high: float = EXPLORE_HIGH, budget: float | None = EXPLORE_BUDGET):
        """budget: the share of decode seconds that forced tree steps may cost beyond their chains (None: no
        bound, every step with K > 0 explores while the evidence is short)."""
        if not 0 <= low < high:
            raise ValueError("tree exploration needs 0 <= low < high rows of evidence")
        if budget is not None and not budget >= 0:
            raise ValueError(f"tree exploration budget must be >= 0, got {budget}")
        self.cost, self.acc, self.low, self.high, self.budget = cost, acceptance, float(low), float(high), budget
        self.exploring = True
        self.steps = 0                       # tree steps verified
        self.seconds = 0.0                   # every decode step's seconds (observe / age)
        self.extra_s = 0.0                   # forced tree steps' predicted seconds beyond their chains'

    def evidence(self) -> float:
        """Rows of depth-1 evidence behind the tree estimate (aged)."""
        return float(self.acc.t[0]) if self.acc.k_max else 0.0

    def explore(self, k: int, rows: int, chain_s: float, chain_rate: float) -> bool:
        """Whether this step (depth k > 0, `rows` rows; the chain it would run: chain_s seconds, chain_rate
        tokens/s) must verify a tree to learn: while the evidence is short (hysteresis between low and high),
        where the tree could pay at all, and within the budget (charged here)."""
        e = self.evidence()
        if self.exploring and e >= self.high:
            self.exploring = False
        elif not self.exploring and e < self.low:
            self.exploring = True
        if not self.exploring:
            return False
        tree_s = float(self.cost.predict(rows)[k])
        if rows * (k + 1) / tree_s <= chain_rate:        # not even with every draft accepted
            return False
        extra = max(0.0, tree_s - chain_s)
        if self.budget is not None and self.extra_s + extra > self.budget * self.seconds:
            return False
        self.extra_s += extra
        return True

    def rates(self, rids, k_max: int) -> tuple:
        """(expected tokens [k_max+1], seconds per step [k_max+1]) of tree steps for this batch."""
        tokens = self.acc.expected_tokens(rids)[: k_max + 1]
        return tokens, self.cost.predict(len(rids))[: k_max + 1]

    def observe(self, rids, k: int, accepted, seconds: float, tree: bool, refine: bool):
        """After any decode step: a tree step adds evidence (and refines the tree cost model); any other step
        only ages the evidence by its rows."""
        if tree and k:
            self.steps += 1
            self.seconds += seconds
            self.acc.observe(rids, k, accepted)
            if refine:
                self.cost.update(len(rids), k, seconds)
        else:
            self.age(len(rids), seconds)

    def age(self, rows: int, seconds: float):
        """A step that verified no tree: the evidence ages by its rows; its seconds count toward the budget."""
        self.acc.age(rows)
        self.seconds += seconds

    def describe(self) -> dict:
        return {"tree_steps": self.steps, "tree_alpha_per_pos": [round(float(x), 4) for x in self.acc.global_alpha()],
                "tree_evidence_rows": round(self.evidence(), 1), "tree_exploring": self.exploring,
                "tree_explore_share": round(self.extra_s / self.seconds, 4) if self.seconds else 0.0}
