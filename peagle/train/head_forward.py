"""Drafter forwards and the loss shared by the EAGLE-3 and P-EAGLE trainers (no KV cache: explicit masks).

Invariant: every structured path (per-document attention, attention in blocks, the KL in blocks or its C++
kernel) gives the values and gradients of its dense reference (masked SDPA over all keys, the op-by-op KL),
which the tests check against it with negative controls.

- ttt_forward: one pass of the head over a block of elements that attend under an explicit mask to the keys
  of earlier passes (``past``) and their own; it returns those keys/values for the next pass (EAGLE-3's
  test-time-training unroll, and P-EAGLE's depth-0 stream that partitioned segments read).
- doc_spans / doc_causal_attend: a stream of whole, contiguous documents attended causally inside each one
  (what the doc-causal mask allows) as one causal attention per document, so no query meets another
  document's keys: about sum(n_i^2)/2 pairs instead of the masked n^2.
- blocked_attend: P-EAGLE's deep elements in blocks of whole rollouts, each over only the keys its queries
  may see. Both attend through train_attention (a C++ softmax in bfloat16 on AVX-512 CPUs, else SDPA).
- draft_loss / DraftKL: KL(target || draft) over the draft vocabulary (or hard labels) and the greedy id."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.layers import attend
from ..sampling import greedy
from .train_attention import block_attention, causal_attention


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
    return causal_attention(q, k, v, spans).reshape(B, T, nh * hd)


def blocked_attend(q, k, v, past, blocks):
    """Deep elements attending in blocks: q [B,T,nh,hd], k/v [B,nkv,T,hd] of the block's elements (ordered so
    that each block is a run of them), past (k, v) [B,nkv,S,hd] -> [B,T,nh*hd]. blocks = [(start, end, ctx,
    mask)]: elements start..end-1 attend to past keys ctx (a slice) and to their own keys under the bool mask
    [end-start, ctx_len + end-start] (every key a query may see must be in its block's set)."""
    B, T, nh, hd = q.shape
    o = block_attention(q, (k, v, past[0], past[1]),
                        [(s, e, [(1, ctx.start, ctx.stop), (0, s, e)], m) for s, e, ctx, m in blocks])
    return o.reshape(B, T, nh * hd)


def ttt_forward(head, ids, hidden, pos, mask, past=None, spans=None, blocks=None):
    """One unroll step for all elements: ids [B,T], hidden [B,T,H], pos [B,T], mask [B|1,1,T,S_past+T].
    past = per-layer (k, v) [B,nkv,S_past,hd] of earlier steps.  spans (no past, no mask): the block is a
    stream of whole documents at these (start, end) rows, attended doc-causally (doc_causal_attend).
    blocks (with past, no mask): blocked_attend's blocks (kv then holds nothing).
    Returns (normed, prenorm, kv)."""
    kv = []

    def attend_for_layer(i):
        def fn(q, k, v):
            if blocks is not None:
                return blocked_attend(q, k, v, past[i], blocks)
            if past is not None:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            kv.append((k, v))
            return doc_causal_attend(q, k, v, spans) if spans is not None else attend(q, k, v, mask)
        return fn
    normed, pre = head.run_layers(ids, hidden, pos, attend_for_layer)
    return normed, pre, kv


KL_CHUNK = 16     # element rows per pass of the torch KL: [16, Vd] float32 blocks stay in the core's cache
FUSED_KL = True   # False: the torch blocks below everywhere (tests, A/B runs)
KL_IMPL = 0       # the kernel's path: 0 best for this CPU, 2 AVX2, 3 AVX-512 (tests)


def _kl_kernel(logits: torch.Tensor, tlogp: torch.Tensor):
    """The C++ extension when it runs these tensors (peagle/csrc/draft_kl.cpp: one pass per element, AVX2 or
    AVX-512), else None."""
    if not (FUSED_KL and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and tlogp.dtype == torch.float32 and logits.shape[-1] % 8 == 0):
        return None
    from ..models import quant_ext
    ext = quant_ext.get()
    return ext if ext is not None and ext.has_avx2() else None   # a loaded build is never stale (quant_ext)


class DraftKL(torch.autograd.Function):
    """KL(target || draft) over the draft vocabulary per element, and the draft's greedy id: logits [E, Vd] (any
    float dtype), tlogp [n, Vd] the target's log-probabilities (normalised over the draft vocabulary), rows [E]
    the tlogp row of each element. With sum(p) = 1,
        KL = sum p * (log p - z) + logsumexp(z),    dKL/dz = softmax(z) - p,
    so forward keeps only logsumexp per element and backward rebuilds softmax(z) - p: no [E, Vd] float32
    temporaries or gathered copy of tlogp. On the CPU with the extension: peagle/csrc/draft_kl.cpp, each element's row
    in one pass (alone 1.8x / 3.9x faster than the torch form below on AVX2 / AVX-512, one thread; see
    docs/training-study/train-cost.md); else torch ops in blocks of KL_CHUNK rows. Both give the op-by-op
    form's values (tests)."""

    @staticmethod
    def forward(ctx, logits, tlogp, rows):
        ext = _kl_kernel(logits, tlogp)
        if ext is not None:   # the kernel reads contiguous rows; backward takes the same path on these
            logits, tlogp, rows = logits.contiguous(), tlogp.contiguous(), rows.contiguous()
            kl, lse, top = ext.draft_kl_forward(logits, tlogp, rows, KL_IMPL)
        else:
            kl, lse, top = _kl_forward_torch(logits, tlogp, rows)
        ctx.ext = ext
        ctx.save_for_backward(logits, tlogp, rows, lse)
        ctx.mark_non_differentiable(top)
        return kl, top

    @staticmethod
    def backward(ctx, g, _):
        logits, tlogp, rows, lse = ctx.saved_tensors
        if ctx.ext is not None:
            return ctx.ext.draft_kl_backward(logits, tlogp, rows, lse, g, KL_IMPL), None, None
        return _kl_backward_torch(logits, tlogp, rows, lse, g), None, None


def _kl_forward_torch(logits, tlogp, rows):
    """DraftKL's forward in torch ops, KL_CHUNK rows at a time -> (kl [E], lse [E], top [E])."""
    E = logits.shape[0]
    kl = torch.empty(E, dtype=torch.float32, device=logits.device)
    lse, top = torch.empty_like(kl), torch.empty(E, dtype=torch.long, device=logits.device)
    for s in range(0, E, KL_CHUNK):
        z = logits[s:s + KL_CHUNK].float()                     # [c, Vd]
        lp = tlogp[rows[s:s + KL_CHUNK]]                       # [c, Vd]
        m, top[s:s + KL_CHUNK] = z.max(-1)                     # sampling.greedy's index (first maximum)
        lse[s:s + KL_CHUNK] = m + (z - m[:, None]).exp_().sum(-1).log_()
        kl[s:s + KL_CHUNK] = (lp.exp() * (lp - z)).sum(-1) + lse[s:s + KL_CHUNK]
    return kl, lse, top


def _kl_backward_torch(logits, tlogp, rows, lse, g):
    """d KL / d logits scaled per element by g [E], KL_CHUNK rows at a time, in the logits' dtype."""
    grad = torch.empty_like(logits)
    for s in range(0, logits.shape[0], KL_CHUNK):
        q = (logits[s:s + KL_CHUNK].float() - lse[s:s + KL_CHUNK, None]).exp_()
        q -= tlogp[rows[s:s + KL_CHUNK]].exp_()
        grad[s:s + KL_CHUNK] = q.mul_(g[s:s + KL_CHUNK, None])
    return grad


def draft_loss(logits: torch.Tensor, tlogp: torch.Tensor, rows: torch.Tensor, label: torch.Tensor,
               hard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [E], greedy draft id [E]) per element: KL(target || draft) over the draft vocabulary (soft
    cross-entropy minus the target's entropy: the same gradient, 0 for a perfect drafter) against tlogp[rows]
    (DraftKL), or with hard=True the cross-entropy of the drafted token's draft id (0 where it is outside the
    draft vocabulary, label -1; tlogp unused)."""
    if not hard:
        return DraftKL.apply(logits, tlogp, rows)
    logq = F.log_softmax(logits.float(), -1)
    return -logq.gather(-1, label.clamp(min=0)[:, None])[:, 0] * (label >= 0), greedy(logits)
