"""Drafter forwards shared by the EAGLE-3 and P-EAGLE training losses (no KV cache: explicit masks).

- ttt_forward: one pass of the head over a block of elements that attend under an explicit mask to the keys
  of earlier passes (``past``) and their own; it returns those keys/values for the next pass (EAGLE-3's
  test-time-training unroll, and P-EAGLE's depth-0 stream that partitioned segments read)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.layers import attend


def ttt_forward(head, ids, hidden, pos, mask, past=None):
    """One unroll step for all elements: ids [B,T], hidden [B,T,H], pos [B,T], mask [B|1,1,T,S_past+T].
    past = per-layer (k, v) [B,nkv,S_past,hd] of earlier steps.  Returns (normed, prenorm, kv)."""
    kv = []

    def attend_for_layer(i):
        def fn(q, k, v):
            if past is not None:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            kv.append((k, v))
            return attend(q, k, v, mask)
        return fn
    normed, pre = head.run_layers(ids, hidden, pos, attend_for_layer)
    return normed, pre, kv


def draft_loss(logits: torch.Tensor, tlogp: torch.Tensor, label: torch.Tensor, hard: bool) -> torch.Tensor:
    """Per-element loss [E]: KL(target || draft) over the draft vocabulary (soft cross-entropy minus the
    target's entropy: the same gradient, 0 for a perfect drafter), or with hard=True the cross-entropy of the
    drafted token's draft id (0 where it is outside the draft vocabulary, label -1)."""
    logq = F.log_softmax(logits.float(), -1)
    if hard:
        return -logq.gather(-1, label.clamp(min=0)[:, None])[:, 0] * (label >= 0)
    logp = tlogp.float()
    return (logp.exp() * (logp - logq)).sum(-1)
