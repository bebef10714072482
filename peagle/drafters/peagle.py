"""P-EAGLE parallel drafting: all K drafts from ONE drafter pass.

Rows per request: the step's shifted rows (accepted tokens + the new token, with target states), then K-1
mask-token rows at the next positions, each with the constant fc(mask_hidden) computed once at load.
The new-token row and the mask rows give d1..dK: each row's argmax, or in "sample" mode, for sampled rows,
independent draws from each slot's q, all in the one pass (the slots do not see each other's drafts, so q_k
does not depend on d_1..d_{k-1}; the verifier's min(1, p/q) test needs only that d_k ~ q_k). K is the
step's (the mask slots are sized per step), at most the K the proposer was built for. The mask rows' KV is
stale after the step and is overwritten by the next step, which starts at the new token's position + 1
(vLLM's semantics)."""
from __future__ import annotations

import torch

from .base import DraftBatch, Proposer


class PEagleProposer(Proposer):
    name = "peagle"

    def __init__(self, head, k, max_len, rows=1, draft_sampling="argmax", dual=False, quantization="none"):
        super().__init__(head, k, max_len, rows, draft_sampling, dual, quantization)
        if not head.parallel:
            raise ValueError("this head has no mask token / mask_hidden: it was not trained for parallel drafting")
        self.mask_h = head.mask_h                                             # fc(mask_hidden), [H]

    @torch.no_grad()
    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        K = k or self.k
        if self.one_greedy_row(batch):
            # the engine's one greedy row: the pass, its LM head and argmax in one extension call where it applies
            span = None if batch.span is None else batch.span + K - 1
            out = self.head.greedy_pass(batch.ids, batch.aux, K - 1, self.cache, batch.b0, batch.start, span,
                                        batch.s0, batch.ids.shape[1] - 1)
            if out is not None:
                batch.q = None
                return out[0]                                                 # [1,K]
        drafts, batch.q = self.pick(self.slots(batch, K), batch.sampled)   # [B,K], [S,K,V] | None
        return drafts

    @torch.no_grad()
    def propose_tree(self, batch: DraftBatch, k: int, topk: int, nodes: int):
        """The tree of the `nodes` most probable paths through the one pass's K slots (peagle/drafters/tree.py)."""
        from .tree import slots_tree
        return slots_tree(self.head, self.head.draft_logits(self.slots(batch, k)), topk, nodes)

    def slots(self, batch: DraftBatch, K: int) -> torch.Tensor:
        """The one drafter pass: the normed outputs of the new-token row and the K-1 mask rows, [B,K,H]."""
        h = self.head
        B, T = batch.ids.shape
        dev = batch.ids.device
        span = None if batch.span is None else batch.span + K - 1
        if B == 1 and batch.s0 is not None:       # the engine's one row: all T entries real, append the mask rows
            ids, hid = batch.ids, h.combine(batch.aux)
            if K > 1:
                ids = torch.cat([ids, ids.new_full((B, K - 1), h.mask_token_id)], 1)
                hid = torch.cat([hid, self.mask_h.expand(B, K - 1, -1)], 1)
            normed, _ = h(ids, hid, None, cache=self.cache, b0=batch.b0, start=batch.start, span=span,
                          s0=batch.s0)
            return normed[:, T - 1:]                                           # [B,K,H]
        W = T + K - 1
        ar = torch.arange(W, device=dev)[None]
        nr = batch.n_real[:, None]
        is_mask = (ar >= nr) & (ar < nr + K - 1)
        ids = torch.zeros(B, W, dtype=torch.long, device=dev)
        ids[:, :T] = batch.ids
        ids = torch.where(ar < nr, ids, torch.where(is_mask, h.mask_token_id, 0))
        hid = torch.zeros(B, W, self.mask_h.shape[0], dtype=self.mask_h.dtype, device=dev)
        hid[:, :T] = h.combine(batch.aux)
        hid = torch.where((ar < nr)[..., None], hid, torch.where(is_mask[..., None], self.mask_h, 0.0))
        normed, _ = h(ids, hid, None, cache=self.cache, b0=batch.b0, start=batch.start, span=span, s0=batch.s0)
        idx = nr - 1 + torch.arange(K, device=dev)[None]                        # new-token row + K-1 mask rows
        return normed[torch.arange(B, device=dev)[:, None], idx]                # [B,K,H]
