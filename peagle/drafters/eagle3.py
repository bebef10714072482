"""Autoregressive EAGLE-3 drafting: K sequential drafter passes per step.

Pass 1 runs the step's shifted rows (accepted tokens + the new token, each with the target state of the
previous position); pass k >= 2 feeds the previous draft with the drafter's own pre-norm output as hidden.
Each pass picks its draft (peagle/drafters/base.py): the argmax, or in "sample" mode, for sampled rows, a draw
from that pass's q -- and the drawn token is what the next pass is fed, so d_k ~ q_k( . | d_1..d_{k-1}), the
chain the verifier's min(1, p/q) test assumes."""
from __future__ import annotations

import torch

from .base import DraftBatch, Proposer


class Eagle3Proposer(Proposer):
    name = "eagle3"

    @torch.no_grad()
    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        h, (B, T), K = self.head, batch.ids.shape, k or self.k
        if self.one_greedy_row(batch):
            drafts = self._greedy_row(batch, K)
            if drafts is not None:
                batch.q = None
                return drafts
        rows = torch.arange(B, device=batch.ids.device)
        normed, pre = h(batch.ids, h.combine(batch.aux), None, cache=self.cache, b0=batch.b0, start=batch.start,
                        span=batch.span, s0=batch.s0)
        last = batch.n_real - 1
        tok, q = self.pick(normed[rows, last][:, None], batch.sampled)   # [B,1], [S,1,V] | None
        g = pre[rows, last]
        drafts, qs = [tok], [q]
        p = batch.start + batch.n_real                 # position of the first draft
        for j in range(1, K):                     # draft j + 1 at position p = start + n_real + j - 1
            span = None if batch.span is None else batch.span + j
            s0 = None if batch.s0 is None else batch.s0 + T + j - 1
            normed, pre = h(tok, g[:, None], None, cache=self.cache, b0=batch.b0, start=p, span=span, s0=s0)
            tok, q = self.pick(normed, batch.sampled)
            g = pre[:, 0]
            drafts.append(tok)
            qs.append(q)
            p = p + 1
        batch.q = None if qs[0] is None else torch.cat(qs, 1)            # [S,K,V]
        return torch.cat(drafts, 1)                                      # [B,K]

    def _greedy_row(self, batch: DraftBatch, K: int) -> torch.Tensor | None:
        """The engine's one greedy row: each pass, its LM head and argmax in one extension call (None where that
        call does not apply: propose's passes run instead)."""
        h, T = self.head, batch.ids.shape[1]
        out = h.greedy_pass(batch.ids, batch.aux, 0, self.cache, batch.b0, batch.start, batch.span, batch.s0, T - 1)
        if out is None:
            return None
        tok, pre = out
        drafts, g, p = [tok], pre[:, T - 1:], batch.start + T          # p: position of the first draft
        for j in range(1, K):
            span = None if batch.span is None else batch.span + j
            tok, g = h.greedy_pass(tok, g, 0, self.cache, batch.b0, p, span, batch.s0 + T + j - 1, 0, fc=False)
            drafts.append(tok)
            p = p + 1
        return torch.cat(drafts, 1)                                      # [1,K]

    @torch.no_grad()
    def propose_tree(self, batch: DraftBatch, k: int, topk: int, nodes: int):
        """EAGLE-2's dynamic tree: one drafter pass per level over its topk best nodes (peagle/drafters/tree.py)."""
        from .tree import expand_tree
        return expand_tree(self, batch, k, topk, nodes)
