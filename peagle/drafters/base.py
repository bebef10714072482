"""One interface for proposers: propose(batch, k) -> draft token ids [B, k] (target vocabulary); k may change
from step to step (1..the k the proposer was built for; None: that k)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.drafter import DrafterHead


@dataclass
class DraftBatch:
    """Per row: the drafter rows this step must add (ids [B,T] = tokens x_{q+1}, aux [B,T,3T] = target aux
    state at q, for positions start..start+n_real-1; rows beyond n_real are padding)."""
    ids: torch.Tensor
    aux: torch.Tensor
    start: torch.Tensor
    n_real: torch.Tensor
    b0: int = 0
    requests: list | None = None   # the engine's Request objects, row-aligned (for context-based proposers)


class Proposer:
    name = "base"

    def __init__(self, head: DrafterHead, k: int, max_len: int, rows: int = 1):
        from ..cache import KVCache
        c = head.cfg
        self.head, self.k = head.prepare_inference(), k
        dtype = head.fc.weight.dtype
        self.cache = KVCache(c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"], max_len, rows, dtype)

    @torch.inference_mode()
    def prefill(self, batch: DraftBatch):
        """Add context rows to the drafter cache without drafting (new requests' prompts)."""
        pos = batch.start[:, None] + torch.arange(batch.ids.shape[1])[None]
        self.head(batch.ids, self.head.combine(batch.aux), pos, cache=self.cache, b0=batch.b0, start=batch.start)

    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def argmax_target(self, normed):
        return self.head.to_target(self.head.draft_logits(normed).argmax(-1))
