"""EAGLE-3 training-time-test (TTT) unroll on packed rows.

Elements are anchors q = 0..n-2 of a packed row.  Step 0 feeds (x[q+1], fc(aux[q])) at position pos(q)
with document-causal attention and predicts x[q+2].  Step k >= 1 feeds the ground-truth token x[q+1+k]
with the drafter's own pre-norm output of step k-1 as hidden state, at RoPE position pos(q)+k; it attends
to the step-0 keys causally plus the keys of steps 1..k at the same index (diagonal extension; this is the
inference view: draft k at position p+k sees the context up to p and the earlier drafts).  Target of step
k is the target's distribution at q+k+1 over the draft vocabulary (soft cross-entropy, logged as KL; or, with
hard=True, cross-entropy on the drafted token x[q+k+2] itself), supervised where x[q+k+2] is an assistant token of
the same document; loss = sum_k decay^k * CE_k / count_k.

Anchor subsampling (keep < 1, :func:`ttt_plan`): step 0 runs every anchor (the keys every later step reads);
step k >= 1 continues a random subset of the anchors step k-1 continued, about keep^k of the step-k
supervised ones, so the work of the unroll drops from ttt passes to ~1/(1-keep) while every continued chain
stays exactly what it would be unsubsampled (tests/test_train_eagle3.py)."""
from __future__ import annotations

import torch

from .cod import supervised
from .common import autocast
from .head_forward import doc_spans, draft_loss, ttt_forward
from .mask import MaskTable


def diag_attend(q, k0, v0, mask0, kd: list, vd: list):
    """Attention of TTT step k >= 1 without materialising the [T, (k+1)T] mask: scores against the step-0
    keys (document-causal mask0) plus, per earlier step j (and this step), the key at the SAME index
    (the diagonal extension), as an elementwise product.  q [B,T,nh,hd] (T <= T0: a subsampled step's anchors);
    k0/v0 [B,nkv,T0,hd]; mask0 [T,T0]; kd/vd lists of [B,nkv,T,hd].  Same result as SDPA over the concatenated
    keys with the diagonal mask."""
    B, T, nh, hd = q.shape
    rep = nh // k0.shape[1]
    ex = (lambda t: t.repeat_interleave(rep, 1)) if rep > 1 else (lambda t: t)
    qh = q.transpose(1, 2)
    scale = hd ** -0.5
    s0 = (qh @ ex(k0).transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~mask0, float("-inf"))
    sd = torch.stack([(qh * ex(k)).sum(-1) for k in kd], -1) * scale            # [B,nh,T,J]
    p = torch.softmax(torch.cat([s0, sd], -1).float(), -1).to(q.dtype)
    T0 = k0.shape[2]                                                            # step-0 keys (>= T when subsampled)
    out = p[..., :T0] @ ex(v0) + (p[..., T0:, None] * torch.stack([ex(v) for v in vd], -2)).sum(-2)
    return out.transpose(1, 2).reshape(B, T, nh * hd)


def ttt_step_diag(head, ids, hidden, pos, mask0, kv0, diag):
    """TTT step k >= 1 (structured attention): kv0 = per-layer step-0 (k, v); diag = per-layer lists of the
    (k, v) of steps 1..k-1 (extended in place with this step's).  Returns (normed, prenorm)."""
    def attend_for_layer(i):
        def fn(q, k, v):
            diag[i][0].append(k)
            diag[i][1].append(v)
            return diag_attend(q, kv0[i][0], kv0[i][1], mask0, diag[i][0], diag[i][1])
        return fn
    return head.run_layers(ids, hidden, pos, attend_for_layer)


def step_counts(row: dict, ttt: int, plan: list | None = None) -> torch.Tensor:
    """Supervised elements per unroll step [ttt] (of the plan's anchors when subsampled)."""
    n = row["ids"].shape[0]
    q = torch.arange(max(n - 1, 0), device=row["doc"].device)
    qs = plan or [q] * ttt
    return torch.stack([supervised(qs[k], torch.full_like(qs[k], k), row["doc"], row["lmask"]).sum()
                        for k in range(ttt)])


def ttt_plan(row: dict, ttt: int, keep: float, gen: torch.Generator | None = None) -> list | None:
    """Anchors run at each unroll step: [all anchors, subset_1, subset_2, ...], each a sorted subset of the
    previous one (a continued chain never has a hole); subset_k = a random floor(keep^k * S_k) of the previous
    step's anchors that are supervised at step k (S_k = all anchors supervised at step k).  None when keep >= 1
    (every anchor at every step)."""
    if keep >= 1:
        return None
    n = row["ids"].shape[0]
    q = torch.arange(max(n - 1, 0), device=row["doc"].device)
    plan, prev = [q], q
    for k in range(1, ttt):
        full = int(supervised(q, torch.full_like(q, k), row["doc"], row["lmask"]).sum())
        cand = prev[supervised(prev, torch.full_like(prev, k), row["doc"], row["lmask"])]
        size = min(len(cand), int(full * keep ** k))
        pick = torch.randperm(len(cand), generator=gen, device=cand.device)[:size]
        prev = cand[pick.sort().values]
        plan.append(prev)
    return plan


def row_step(head, row: dict, table: MaskTable, ttt: int, counts: torch.Tensor, decay: float = 0.8,
             backward: bool = True, autocast_dtype=None, dense: bool = False, plan: list | None = None,
             hard: bool = False, by_document: bool = True) -> dict:
    """Forward (+ backward) of the TTT unroll on one row; counts [ttt] = batch-wide supervised counts.
    dense=True runs step 0 under the document-causal mask and steps >= 1 as SDPA over all earlier steps' keys
    with the [T, (k+1)T] diagonal-extension mask (the reference); the default attends step 0 one document at a
    time and computes the diagonal part elementwise (same values, ~(k+1)x less attention work).  plan
    (:func:`ttt_plan`): the anchors each step runs (default: all); hard: cross-entropy
    on the drafted token instead of the target's distribution; by_document=False: step 0 under the mask."""
    n = row["ids"].shape[0]
    doc = row["doc"]
    q_all = torch.arange(n - 1, device=doc.device)
    C_all = table.doc_causal(doc[: n - 1])
    if plan is not None and dense:
        raise ValueError("the dense reference runs every anchor (plan=None)")
    correct = torch.zeros(ttt, dtype=torch.long, device=doc.device)
    total = torch.zeros(ttt, dtype=torch.long, device=doc.device)
    ce_sum = torch.zeros(ttt, device=doc.device)
    loss = 0.0
    kv0, hidden = None, None
    diag = [([], []) for _ in head.layers]
    with autocast(head.fc.weight.device, autocast_dtype):
        q, C = q_all, C_all
        for k in range(ttt):
            if plan is not None and k >= 1:
                # continue only this step's anchors: keep their rows of everything the chain carries
                loc = torch.searchsorted(q, plan[k].to(q.device))
                if not torch.equal(q[loc.clamp(max=max(len(q) - 1, 0))], plan[k].to(q.device)):
                    raise ValueError(f"plan step {k} is not a subset of step {k - 1}'s anchors")
                q, C, hidden = q[loc], C_all[plan[k].to(q.device)], hidden[loc]
                for ks, vs in diag:
                    ks[:] = [t[:, :, loc] for t in ks]
                    vs[:] = [t[:, :, loc] for t in vs]
                if len(q) == 0:
                    break
            ids = row["ids"][(q + 1 + k).clamp(max=n - 1)]
            pos = row["pos"][q] + k
            if k == 0:
                hidden = head.combine(row["aux"][: n - 1].to(head.fc.weight.dtype))
                # step 0 is every anchor, whole documents: one causal attention per document (dense: the mask)
                spans = doc_spans(doc[: n - 1]) if by_document and not dense else None
                normed, pre, kv0 = ttt_forward(head, ids[None], hidden[None], pos[None],
                                               None if spans else C_all[None, None], spans=spans)
            elif dense:
                mask = table.eagle3(C, k)[None, None]
                normed, pre, kv0 = ttt_forward(head, ids[None], hidden[None], pos[None], mask, kv0)
            else:
                normed, pre = ttt_step_diag(head, ids[None], hidden[None], pos[None], C, kv0, diag)
            hidden = pre[0]
            s = supervised(q, torch.full_like(q, k), doc, row["lmask"])
            if not bool(s.any()) or counts[k] == 0:
                continue
            logits = head.draft_logits(normed[0, s])
            label = row["label"][(q + k + 2)[s]]
            ce, top = draft_loss(logits, row["tlogp"], (q + k + 1)[s], label, hard)
            loss = loss + (decay ** k) * ce.sum() / float(counts[k])
            with torch.no_grad():
                ce_sum[k] = ce.sum()
                ok = top == label
                total[k] += s.sum()
                correct[k] += ok.sum()
    if backward and torch.is_tensor(loss):
        loss.backward()
    return {"ce": ce_sum, "correct": correct, "total": total}
