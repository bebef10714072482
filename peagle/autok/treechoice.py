"""Tree or chain, per step: what auto K adds when the engine has token trees (peagle/tree.py).

A tree step of depth K verifies more positions than a chain step of the same K (its nodes + 1, and EAGLE-3
drafts one pass per level), so it costs more and must accept more to pay. Auto K prices both: the chain from its
own cost model and acceptance (auto.py), the tree from a cost model measured on tree steps and an acceptance
estimate learned from tree steps only (the same per-depth bookkeeping, acceptance.py: a tree step that accepted a
nodes along its path is one trial of depths 1..a+1 and one success of depths 1..a). Per K the faster of the two
stands for that K; the K (or plain decoding) is then chosen as without trees.

Invariant: the choice depends only on earlier steps (never on this step's draws), so switching between tree and
chain keeps greedy outputs identical; sampled batches verify their chain whatever is chosen (the engine).

Exploration: a tree's acceptance cannot be known before trees are verified, and an estimate that starts at the
chain's prior would never pick the costlier tree. So while the tree's evidence at depth 1 is below `low` rows,
every step with K > 0 verifies a tree until `high` rows are in; evidence ages with every row-step (tree or not),
so a tree left unused is tried again after about two half-lives (acceptance.py's half_life_rows)."""
from __future__ import annotations

from .acceptance import Acceptance
from .costmodel import CostModel

EXPLORE_LOW, EXPLORE_HIGH = 16.0, 64.0     # rows of depth-1 evidence: start / stop trying trees


class TreeChoice:
    def __init__(self, cost: CostModel, acceptance: Acceptance, low: float = EXPLORE_LOW,
                 high: float = EXPLORE_HIGH):
        if not 0 <= low < high:
            raise ValueError("tree exploration needs 0 <= low < high rows of evidence")
        self.cost, self.acc, self.low, self.high = cost, acceptance, float(low), float(high)
        self.exploring = True
        self.steps = 0                       # tree steps verified

    def evidence(self) -> float:
        """Rows of depth-1 evidence behind the tree estimate (aged)."""
        return float(self.acc.t[0]) if self.acc.k_max else 0.0

    def explore(self) -> bool:
        """Whether the next step with K > 0 must verify a tree (hysteresis between low and high)."""
        e = self.evidence()
        if self.exploring and e >= self.high:
            self.exploring = False
        elif not self.exploring and e < self.low:
            self.exploring = True
        return self.exploring

    def rates(self, rids, k_max: int) -> tuple:
        """(expected tokens [k_max+1], seconds per step [k_max+1]) of tree steps for this batch."""
        tokens = self.acc.expected_tokens(rids)[: k_max + 1]
        return tokens, self.cost.predict(len(rids))[: k_max + 1]

    def observe(self, rids, k: int, accepted, seconds: float, tree: bool, refine: bool):
        """After any decode step: a tree step adds evidence (and refines the tree cost model); any other step
        only ages the evidence by its rows."""
        if tree and k:
            self.steps += 1
            self.acc.observe(rids, k, accepted)
            if refine:
                self.cost.update(len(rids), k, seconds)
        else:
            self.acc.age(len(rids))

    def describe(self) -> dict:
        return {"tree_steps": self.steps, "tree_alpha_per_pos": [round(float(x), 4) for x in self.acc.global_alpha()],
                "tree_evidence_rows": round(self.evidence(), 1), "tree_exploring": self.exploring}
