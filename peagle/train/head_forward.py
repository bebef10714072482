"""Drafter forwards shared by the EAGLE-3 and P-EAGLE training losses (no KV cache: explicit masks).

- ttt_forward: one pass of the head over a block of elements that attend under an explicit mask to the keys
  of earlier passes (``past``) and their own; it returns those keys/values for the next pass (EAGLE-3's
  test-time-training unroll, and P-EAGLE's depth-0 stream that partitioned segments read).
- doc_spans / doc_causal_attend: a stream of whole, contiguous documents attended causally inside each one
  (what the doc-causal mask allows) as one causal SDPA per document, so no query meets another document's
  keys: about sum(n_i^2)/2 pairs instead of the masked n^2."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.layers import attend


def doc_spans(doc: torch.Tensor) -> list[tuple[int, int]]:
    """doc [n] (contiguous document ids) -> [(start, end)] of each document's run (one host read)."""
    n = doc.shape[0]
    if n == 0:
        return []
    cut = ((doc[1:] != doc[:-1]).nonzero().flatten() + 1).tolist()
    return list(zip([0] + cut, cut + [n]))


def doc_causal_attend(q, k, v, spans):
    """q [B,T,nh,hd], k/v [B,nkv,T,hd] of one stream whose documents are the spans -> [B,T,nh*hd]: each
    document's queries over its own keys, causally (the doc-causal mask's result)."""
    B, T, nh, hd = q.shape
    qt = q.transpose(1, 2)
    o = torch.cat([F.scaled_dot_product_attention(qt[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                  enable_gqa=(k.shape[1] != nh)) for s, e in spans], 2)
    return o.transpose(1, 2).reshape(B, T, nh * hd)


def ttt_forward(head, ids, hidden, pos, mask, past=None, spans=None):
    """One unroll step for all elements: ids [B,T], hidden [B,T,H], pos [B,T], mask [B|1,1,T,S_past+T].
    past = per-layer (k, v) [B,nkv,S_past,hd] of earlier steps.  spans (no past, no mask): the block is a
    stream of whole documents at these (start, end) rows, attended doc-causally (doc_causal_attend).
    Returns (normed, prenorm, kv)."""
    kv = []

    def attend_for_layer(i):
        def fn(q, k, v):
            if past is not None:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            kv.append((k, v))
            return doc_causal_attend(q, k, v, spans) if spans is not None else attend(q, k, v, mask)
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
