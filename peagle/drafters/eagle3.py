"""Autoregressive EAGLE-3 drafting: K sequential drafter passes per step.

Pass 1 runs the step's shifted rows (accepted tokens + the new token, each with the target state of the
previous position); pass k >= 2 feeds the previous draft with the drafter's own pre-norm output as hidden."""
from __future__ import annotations

import torch

from .base import DraftBatch, Proposer


class Eagle3Proposer(Proposer):
    name = "eagle3"

    @torch.no_grad()
    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        h, (B, T), K = self.head, batch.ids.shape, k or self.k
        rows = torch.arange(B, device=batch.ids.device)
        normed, pre = h(batch.ids, h.combine(batch.aux), None, cache=self.cache, b0=batch.b0, start=batch.start,
                        span=batch.span, s0=batch.s0)
        last = batch.n_real - 1
        tok = self.argmax_target(normed[rows, last])
        g = pre[rows, last]
        drafts = [tok]
        p = batch.start + batch.n_real                 # position of the first draft
        for j in range(1, K):                     # draft j + 1 at position p = start + n_real + j - 1
            span = None if batch.span is None else batch.span + j
            s0 = None if batch.s0 is None else batch.s0 + T + j - 1
            normed, pre = h(tok[:, None], g[:, None], None, cache=self.cache, b0=batch.b0, start=p, span=span, s0=s0)
            tok = self.argmax_target(normed[:, 0])
            g = pre[:, 0]
            drafts.append(tok)
            p = p + 1
        return torch.stack(drafts, 1)
