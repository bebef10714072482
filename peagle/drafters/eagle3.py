"""Autoregressive EAGLE-3 drafting: K sequential drafter passes per step.

Pass 1 runs the step's shifted rows (accepted tokens + the new token, each with the target state of the
previous position); pass k >= 2 feeds the previous draft with the drafter's own pre-norm output as hidden."""
from __future__ import annotations

import torch

from .base import DraftBatch, Proposer


class Eagle3Proposer(Proposer):
    name = "eagle3"

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        h, B, K = self.head, batch.ids.shape[0], k or self.k
        rows = torch.arange(B)
        pos = batch.start[:, None] + torch.arange(batch.ids.shape[1])[None]
        normed, pre = h(batch.ids, h.combine(batch.aux), pos, cache=self.cache, b0=batch.b0, start=batch.start)
        last = batch.n_real - 1
        tok = self.argmax_target(normed[rows, last])
        g = pre[rows, last]
        drafts = [tok]
        p = batch.start + batch.n_real                 # position of the first draft
        for _ in range(1, K):
            normed, pre = h(tok[:, None], g[:, None], p[:, None], cache=self.cache, b0=batch.b0, start=p)
            tok = self.argmax_target(normed[:, 0])
            g = pre[:, 0]
            drafts.append(tok)
            p = p + 1
        return torch.stack(drafts, 1)
