"""One interface for proposers: propose(batch, k) -> draft token ids [B, k] (target vocabulary), on the device;
k may change from step to step (1..the k the proposer was built for; None: that k).

Draft sampling (the speculative config's "draft_sampling", peagle/spec_config.py): a proposer built with
"argmax" drafts every row's argmax; one built with "sample" draws the drafts of the batch's sampled rows
(batch.sampled, the temperature > 0 rows) from its distribution q -- the draft logits processed with the row's
own temperature / top-k / top-p, as the verifier processes the target's (peagle/sampling.py) -- with the row's
generator, and leaves q over the target vocabulary (zero outside the draft vocabulary) in batch.q for the
verifier (peagle/verify.py). Greedy rows draft the argmax in both modes. Invariant: a proposer that leaves
batch.q None drafts deterministically from the context (its q is one-hot, which the verifier then assumes).

A proposer never reads device values back to the host: the engine hands it host-side facts (span, s0) with
each batch, as the target's forward gets them (see peagle/models/layers.py BlockCtx)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..heads.model import DrafterHead
from ..sampling import probs_from_logits, sample_rows
from ..spec_config import DRAFT_SAMPLING
from ..verify import SampledRows


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
    sampled: "SampledRows | None" = None   # in: the sampled rows (peagle/verify.py), drawn from q in "sample" mode
    q: torch.Tensor | None = None          # out: [S,k,V] the q each sampled row's drafts were drawn from


class Proposer:
    name = "base"
    draft_sampling = "argmax"

    def __init__(self, head: DrafterHead, k: int, max_len: int, rows: int = 1, draft_sampling: str = "argmax",
                 dual: bool = False):
        """dual: keep the head's weights in both layouts, as the target does (its `dual_layout`)."""
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
        c = head.config
        self.head, self.k, self.draft_sampling = head.prepare_inference(dual), k, draft_sampling
        w = head.fc.weight
        # no lengths of its own: the engine derives the drafter's valid length (peagle/engine.py)
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, rows, w.dtype,
                             w.device, lens=False)

    @torch.no_grad()
    def prefill(self, batch: DraftBatch):
        """Add context rows to the drafter cache without drafting (new requests' prompts)."""
        self.head(batch.ids, self.head.combine(batch.aux), None, cache=self.cache, b0=batch.b0, start=batch.start,
                  span=batch.span, s0=batch.s0)

    def propose(self, batch: DraftBatch, k: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def pick(self, normed: torch.Tensor, sampled: "SampledRows | None"):
        """normed [B,J,H] (J draft slots per row) -> (draft ids [B,J] in the target vocabulary, q [S,J,V] or None).
        Every row's argmax; in "sample" mode the sampled rows' slots are drawn from their q instead (all slots
        at once, each row with its own generator) and q comes back over the target vocabulary."""
        h = self.head
        logits = h.draft_logits(normed)                                              # [B,J,Vd]
        ids = logits.argmax(-1)                                                      # [B,J]
        if sampled is None or self.draft_sampling != "sample":
            return h.to_target(ids), None
        qd = probs_from_logits(logits[sampled.index], sampled.temperature, sampled.top_k, sampled.top_p)
        ids[sampled.index] = sample_rows(qd, sampled.gens)                           # [S,J]
        to_t = h.to_target(torch.arange(qd.shape[-1], device=qd.device))            # [Vd] draft id -> target id
        q = qd.new_zeros(qd.shape[:-1] + (h.config.vocab_size,)).index_copy_(-1, to_t, qd)   # [S,J,V]
        return h.to_target(ids), q
