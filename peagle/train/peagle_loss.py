"""P-EAGLE training step on packed rows: COD elements, the pre-computed mask, optional sequence partitioning.

A row (dict) holds: ids [n] tokens, doc [n] document index (contiguous), pos [n] position inside the
document, lmask [n] assistant-token mask, aux [n, 3T] target aux states, tlogp [n, Vd] the target's
log-probabilities over the draft vocabulary at each position (distribution of the next token), label [n]
the draft id of each token (-1 when outside the draft vocabulary).

Loss = sum over supervised elements of KL(target || draft) over the draft vocabulary, divided by the count
of supervised elements in the whole (multi-row, multi-rank) batch.  Partitioned and flat passes give the
same gradients (tests/test_train_peagle.py)."""
from __future__ import annotations

import bisect

import torch

from .cod import sample_cod, supervised
from .common import autocast
from .head_forward import doc_spans, draft_loss, ttt_forward
from .mask import MaskTable
from .partition import owned_segments


def make_elements(row: dict, K: int, r: float = 0.7, r_min: float = 0.2, gen=None, full=False) -> dict:
    anchor, depth = sample_cod(row["doc"], row["lmask"], K, r, r_min, gen, full)
    sup = supervised(anchor, depth, row["doc"], row["lmask"])
    return {"anchor": anchor, "depth": depth, "sup": sup}


def element_inputs(head, row: dict, a: torch.Tensor, d: torch.Tensor):
    """(ids [E], hidden [E,H], pos [E]) for elements in depth-major order (depth-0 first)."""
    n = row["ids"].shape[0]
    zero = d == 0
    n0 = int(zero.sum())
    assert bool(zero[:n0].all()), "elements must be depth-major (depth 0 first)"
    ids = torch.where(zero, row["ids"][(a + 1).clamp(max=n - 1)], torch.full_like(a, head.mask_token_id))
    h0 = head.combine(row["aux"][a[:n0]].to(head.fc.weight.dtype))
    if n0 < len(a):
        hm = head.combine(head.mask_hidden.reshape(1, -1)).expand(len(a) - n0, -1)
        hidden = torch.cat([h0, hm], 0)
    else:
        hidden = h0
    return ids, hidden, row["pos"][a] + d


def draft_forward(head, row, a, d, table: MaskTable, C=None):
    """Training forward of an element list (no cache): normed [E, H]."""
    C = table.doc_causal(row["doc"]) if C is None else C
    ids, hidden, pos = element_inputs(head, row, a, d)
    mask = table.peagle(C, a, d)[None, None]
    normed, _ = head(ids[None], hidden[None], pos[None], ctx_mask=mask)
    return normed[0]


def _kl_stats(head, normed, row, a, d, denom, K, acc, hard=False):
    """Sum the loss (KL, or hard cross-entropy) over the given (supervised) elements; returns (scaled loss,
    loss sum) and updates acc."""
    logits = head.draft_logits(normed)
    label = row["label"][a + d + 2]
    kl, top = draft_loss(logits, row["tlogp"], a + d + 1, label, hard)
    with torch.no_grad():
        ok = top == label
        acc[1] += torch.bincount(d, minlength=K)[:K]
        acc[0] += torch.bincount(d[ok], minlength=K)[:K]
    return kl.sum() / denom, float(kl.detach().sum())


DEEP_BLOCK = 128     # deep elements per attention block (whole rollouts: blocks end where an anchor does)


def deep_blocks(a, d, a0, d0, C, table: MaskTable, spans) -> list:
    """blocked_attend's blocks for a segment's deep elements in anchor-major order (a [E], d [E]) over the
    whole-document depth-0 stream (a0, d0; spans): about DEEP_BLOCK elements per block, never splitting an
    anchor's rollout; a block's context is the depth-0 keys from its first anchor's document start to its
    last anchor, what the P-EAGLE mask lets any of its queries see. One host read of the anchors."""
    E, al = a.shape[0], a.tolist()
    starts = [s for s, _ in spans]
    blocks, s = [], 0
    while s < E:
        e = min(s + DEEP_BLOCK, E)
        while e < E and al[e] == al[e - 1]:
            e += 1
        doc_start = starts[bisect.bisect_right(starts, al[s]) - 1]
        ctx = slice(doc_start, al[e - 1] + 1)
        mask = table.peagle(C, a[s:e], d[s:e], torch.cat([a0[ctx], a[s:e]]), torch.cat([d0[ctx], d[s:e]]))
        blocks.append((s, e, ctx, mask))
        s = e
    return blocks


def row_step(head, row: dict, el: dict, table: MaskTable, K: int, denom: float, seg_len: int = 0,
             backward: bool = True, autocast_dtype=None, hard: bool = False, by_document: bool = True) -> dict:
    """Forward (+ backward) of one row; gradients accumulate with loss scale 1/denom (hard: cross-entropy
    on the drafted token instead of KL to the target's distribution).
    Returns {"kl": sum KL, "correct": [K], "total": [K]}.

    seg_len = 0: the flat pass, one forward over all elements with the full mask (the reference).
    seg_len > 0: sequence partitioning.  The depth-0 elements form an ordinary causal stream that does not
    depend on deeper elements, so it is computed once (its graph kept, O(n*H*layers) memory) and serves as
    the keys/values context of every segment; segment s then runs its own deep elements (anchors in
    [s*L, (s+1)*L)) over [depth-0 keys | own keys], plus the logits of its own depth-0 elements, and does its
    own backward into the parameters and into leaf copies of the depth-0 outputs/keys/values; one final
    backward pushes the accumulated leaf gradients through the depth-0 stream.  Attention work drops from (3.4n)^2
    to ~3.4n^2 and peak memory from O((3.4n)^2) to O(n * 3.4L); the accumulated gradient equals the flat pass's
    (tests/test_train_peagle.py). With COD's elements (depth 0 = every anchor) the depth-0 stream attends one
    document at a time, and a segment's deep elements attend in blocks of whole rollouts, each block over the
    depth-0 keys of its own anchors' documents up to its last anchor (deep_blocks: what the masks allow anyway);
    by_document=False keeps the masked attention over every depth-0 key (the reference). A segment's supervised
    elements of every depth share one logits product."""
    if seg_len <= 0:
        return _row_step_flat(head, row, el, table, K, denom, backward, autocast_dtype, hard)
    anchor, depth, sup = el["anchor"], el["depth"], el["sup"]
    C = table.doc_causal(row["doc"])
    acc = [torch.zeros(K, dtype=torch.long, device=anchor.device) for _ in range(2)]
    kl_sum = 0.0
    n0 = int((depth == 0).sum())
    a0, d0 = anchor[:n0], depth[:n0]
    # COD's depth-0 anchors are 0..n0-1 (make_elements): the stream is whole documents, attended one by one,
    # and a segment's deep elements need only the depth-0 keys of the documents their anchors are in
    whole = by_document and n0 > 0 and int(a0[0]) == 0 and int(a0[-1]) == n0 - 1
    spans = doc_spans(row["doc"][:n0]) if whole else None
    with autocast(head.fc.weight.device, autocast_dtype):
        ids0, hid0, pos0 = element_inputs(head, row, a0, d0)
        normed0_g, _, kv0_g = ttt_forward(head, ids0[None], hid0[None], pos0[None],
                                          None if whole else C[a0][:, a0][None, None], spans=spans)
    # segments read detached leaf copies of the depth-0 stream; their gradients accumulate on the leaves and
    # flow back through the depth-0 graph ONCE at the end (not once per segment)
    leaf = lambda t: t.detach().requires_grad_(backward)
    normed0 = leaf(normed0_g)
    kv0 = [(leaf(k), leaf(v)) for k, v in kv0_g]
    for _, own in owned_segments(anchor, seg_len):
        o0 = (own & sup)[:n0].nonzero().flatten()
        od = (own & sup).nonzero().flatten()
        od = od[od >= n0]
        deep = own.nonzero().flatten()
        deep = deep[deep >= n0]
        if len(o0) == 0 and len(od) == 0:
            continue
        with autocast(head.fc.weight.device, autocast_dtype):
            rows_n, rows_a, rows_d = [normed0[0, o0]], [a0[o0]], [d0[o0]]
            if len(od):
                # the segment's deep elements (all of them: supervised ones may attend to unsupervised
                # shallower slots of their rollout) over [depth-0 context | own deep elements]
                if whole:   # anchor-major: blocks of whole rollouts (blocked_attend)
                    deep = deep[torch.sort(anchor[deep], stable=True).indices]
                a, d = anchor[deep], depth[deep]
                ids, hid, pos = element_inputs(head, row, a, d)
                blocks = deep_blocks(a, d, a0, d0, C, table, spans) if whole else None
                mask = None if whole else table.peagle(C, a, d, torch.cat([a0, a]), torch.cat([d0, d]))[None, None]
                normed, _, _ = ttt_forward(head, ids[None], hid[None], pos[None], mask, past=kv0, blocks=blocks)
                keep = sup[deep]
                rows_n.append(normed[0, keep])
                rows_a.append(a[keep])
                rows_d.append(d[keep])
            # the segment's supervised elements of every depth in one logits product (one weight gradient)
            loss, k = _kl_stats(head, torch.cat(rows_n), row, torch.cat(rows_a), torch.cat(rows_d), denom, K,
                                acc, hard)
            kl_sum += k
        if backward:
            loss.backward()
    if backward:
        outs, grads = [], []
        for g_t, l_t in zip([normed0_g] + [t for kv in kv0_g for t in kv], [normed0] + [t for kv in kv0 for t in kv]):
            if l_t.grad is not None:
                outs.append(g_t)
                grads.append(l_t.grad)
        if outs:
            torch.autograd.backward(outs, grads)
    return {"kl": kl_sum, "correct": acc[0], "total": acc[1]}


def _row_step_flat(head, row, el, table, K, denom, backward, autocast_dtype, hard=False):
    anchor, depth, sup = el["anchor"], el["depth"], el["sup"]
    acc = [torch.zeros(K, dtype=torch.long, device=anchor.device) for _ in range(2)]
    if not bool(sup.any()):
        return {"kl": 0.0, "correct": acc[0], "total": acc[1]}
    with autocast(head.fc.weight.device, autocast_dtype):
        normed = draft_forward(head, row, anchor, depth, table)
        loss, kl = _kl_stats(head, normed[sup], row, anchor[sup], depth[sup], denom, K, acc, hard)
    if backward:
        loss.backward()
    return {"kl": kl, "correct": acc[0], "total": acc[1]}
