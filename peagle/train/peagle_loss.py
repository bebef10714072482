"""P-EAGLE training step on packed rows: COD elements, the pre-computed mask, optional sequence partitioning.

A row (dict) holds: ids [n] tokens, doc [n] document index (contiguous), pos [n] position inside the
document, lmask [n] assistant-token mask, aux [n, 3T] target aux states, tlogp [n, Vd] the target's
log-probabilities over the draft vocabulary at each position (distribution of the next token), label [n]
the draft id of each token (-1 when outside the draft vocabulary).

Loss = sum over supervised elements of KL(target || draft) over the draft vocabulary, divided by the count
of supervised elements in the whole (multi-row, multi-rank) batch.  Partitioned and flat passes give the
same gradients (tests/test_train_peagle.py)."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from .cod import sample_cod, supervised
from .mask import MaskTable
from .partition import segments


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


def _autocast(dtype):
    if dtype == torch.bfloat16:
        return torch.autocast("cpu" if not torch.cuda.is_available() else "cuda", dtype=torch.bfloat16)
    return nullcontext()


def row_step(head, row: dict, el: dict, table: MaskTable, K: int, denom: float, seg_len: int = 0,
             backward: bool = True, autocast_dtype=None, module=None) -> dict:
    """Forward (+ backward) of one row, flat (seg_len=0) or partitioned.  Gradients accumulate into the
    head's parameters with loss scale 1/denom.  `module` (optional) is what forward is called through
    (e.g. a DDP wrapper of head).  Returns {"kl": sum KL, "correct": [K], "total": [K]}."""
    fwd = module if module is not None else head
    anchor, depth, sup = el["anchor"], el["depth"], el["sup"]
    C = table.doc_causal(row["doc"])
    kl_sum = 0.0
    correct = torch.zeros(K, dtype=torch.long)
    total = torch.zeros(K, dtype=torch.long)
    for idx, own in segments(anchor, depth, seg_len):
        a, d = anchor[idx], depth[idx]
        s = own & sup[idx]
        if not bool(s.any()):
            continue  # no owned supervised element: contributes nothing (forward-only context)
        with _autocast(autocast_dtype):
            ids, hidden, pos = element_inputs(head, row, a, d)
            mask = table.peagle(C, a, d)[None, None]
            normed, _ = fwd(ids[None], hidden[None], pos[None], ctx_mask=mask)
            logits = head.draft_logits(normed[0, s])
        logq = F.log_softmax(logits.float(), -1)
        tgt = (a + d + 1)[s]
        logp = row["tlogp"][tgt].float()
        kl = (logp.exp() * (logp - logq)).sum(-1)
        loss = kl.sum() / denom
        if backward:
            loss.backward()
        kl_sum += float(kl.detach().sum())
        with torch.no_grad():
            ok = logits.argmax(-1) == row["label"][(a + d + 2)[s]]
            ds = d[s]
            total += torch.bincount(ds, minlength=K)[:K]
            correct += torch.bincount(ds[ok], minlength=K)[:K]
    return {"kl": kl_sum, "correct": correct, "total": total}


def count_supervised(el: dict) -> int:
    return int(el["sup"].sum())
