"""One interface for proposers: propose(batch, k) -> draft token ids [B, k] (target vocabulary), on the device;
k may change from step to step (1..the k the proposer was built for; None: that k).

A proposer never reads device values back to the host: the engine hands it host-side facts (span, s0) with
each batch, as the target's forward gets them (see peagle/models/layers.py BlockCtx)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.drafter import DrafterHead


@dataclass
class DraftBatch:
    """Per row: the drafter rows this step must add (ids [B,T] = tokens x_{q+1}, aux [B,T,3T] = target aux
    state at q, for positions start..start+n_real-1; rows beyond n_real are padding).
    span: a host-side upper bound of max(start) + T (None: read from start on the host, for tools and tests);
    s0: the host start shared by all rows when every row also has n_real == T (the engine gives it for one row)."""
    ids: torch.Tensor
    aux: torch.Tensor
    start: torch.Tensor
    n_real: torch.Tensor
    b0: int = 0
    requests: list | None = None   # the engine's Request objects, row-aligned (for context-based proposers)
    span: int | None = None
    s0: int | None = None


class Proposer:
    name = "base"

    def __init__(self, head: DrafterHead, k: int, max_len: int, rows: int = 1):
        from ..cache import KVCache
        c = head.cfg
        self.head, self.k = head.prepare_inference(), k
        w = head.fc.weight
        # no lengths of its own: the engine derives the drafter's valid length (peagle/engine.py)
        self.cache = KVCache(c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"], max_len, rows, w.dtype,
                             w.device, lens=False)

    @torch.no_grad()
    def prefill(self, batch: DraftBatch):
        """Add context rows to the drafter cache without drafting (new requests' prompts)."""
        self.head(batch.ids, self.head.combine(batch.aux), None, cache=self.cache, b0=batch.b0, start=batch.start,
                  span=batch.span, s0=batch.s0)

    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def argmax_target(self, normed):
        return self.head.to_target(self.head.draft_logits(normed).argmax(-1))
