"""Speculative-decoding metrics with vLLM's definitions, plus the K used per decode step (K may change
between steps: `num_steps_per_k[K]` counts the steps that drafted K tokens per request, K = 0 included).
`extra`, if set, returns more entries for as_dict (the engine's K policy state)."""
from __future__ import annotations


class SpecMetrics:
    def __init__(self, k: int):
        self.k = k
        self.extra = None
        self.reset()

    def reset(self):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k
        self.num_steps_per_k = [0] * (self.k + 1)
        # host wall time of each phase (on CUDA the device runs ahead; the step's one copy waits for it in
        # the verify phase): admitting requests (target + drafter prefill), drafting, verifying
        self.prefill_time_s = self.draft_time_s = self.verify_time_s = 0.0
        # token trees (peagle/tree.py): draft nodes verified (a device tensor, read by as_dict only) and rows
        self.tree_nodes, self.tree_rows = 0, 0

    def add_draft(self, accepted: int, k: int):
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def add_tree(self, nodes, rows: int):
        """A tree step: `nodes` draft nodes verified over `rows` rows (nodes may be a device scalar)."""
        self.tree_nodes = self.tree_nodes + nodes
        self.tree_rows += rows

    def add_step(self, k: int):
        self.num_steps_per_k[k] += 1

    def as_dict(self) -> dict:
        d = self.num_drafts
        return {
            "num_drafts": d, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / d if d else 1.0,
            "acceptance_rate_per_pos": [a / d if d else 0.0 for a in self.num_accepted_tokens_per_pos],
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "prefill_time_s": self.prefill_time_s, "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "num_steps_per_k": list(self.num_steps_per_k),
            "mean_num_speculative_tokens": sum(k * n for k, n in enumerate(self.num_steps_per_k))
            / max(sum(self.num_steps_per_k), 1),
        } | self._tree_dict() | (self.extra() if self.extra is not None else {})

    def _tree_dict(self) -> dict:
        """Token trees: nodes verified and tokens accepted per row and step (absent without tree steps)."""
        if not self.tree_rows:
            return {}
        n = int(self.tree_nodes)
        return {"num_tree_rows": self.tree_rows, "num_tree_nodes": n, "mean_tree_nodes_per_step": n / self.tree_rows,
                "mean_accepted_per_step": self.num_accepted_tokens / max(self.num_drafts, 1)}
