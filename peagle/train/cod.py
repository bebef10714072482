"""COD (conditional drop-token) sampling of P-EAGLE training elements.

A packed row holds tokens x[0..n-1] of one or more documents (doc[p] = document index, contiguous).
An *element* (anchor q, depth d) is one drafter row:
  depth 0: token x[q+1] + target aux state at q, RoPE position pos(q)      -> predicts x[q+2]
  depth d: mask token + mask_hidden,               RoPE position pos(q)+d  -> predicts x[q+d+2]
(pos = position inside the document; this is exactly what the inference proposer feeds).
Element (q, d) is *supervised* iff q+d+2 < n, doc[q+d+2] == doc[q] and loss_mask[q+d+2].

Depth 0 keeps every anchor 0..n-2 (prompt positions act as context).  Depth d >= 1 keeps about
max(r^d, r_min) of the supervised seeds, drawn only among anchors whose depth-(d-1) element was kept and
whose depth-d element is supervised (so a rollout never has holes).  Element order is depth-major:
all depth-0 anchors ascending, then depth 1 ascending, ...
"""
from __future__ import annotations

import math

import torch


def supervised(anchor: torch.Tensor, depth: torch.Tensor, doc: torch.Tensor, lmask: torch.Tensor) -> torch.Tensor:
    n = doc.shape[0]
    tgt = anchor + depth + 2
    ok = tgt < n
    t = tgt.clamp(max=n - 1)
    return ok & (doc[t] == doc[anchor]) & lmask[t].bool()


def cod_sizes(n_seed: int, K: int, r: float, r_min: float) -> list[int]:
    """Target number of depth-d elements for d = 1..K-1 (the reference's floor(max(0,|S|-d)*max(r^d,r_min)))."""
    return [int(math.floor(max(0, n_seed - d) * max(r ** d, r_min))) for d in range(1, K)]


def sample_cod(doc: torch.Tensor, lmask: torch.Tensor, K: int, r: float = 0.7, r_min: float = 0.2,
               gen: torch.Generator | None = None, full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (anchor [E], depth [E]) in depth-major order.  full=True keeps every supervised rollout slot
    (no subsampling; used by tests and the parity check)."""
    n = doc.shape[0]
    a0 = torch.arange(max(n - 1, 0), device=doc.device)
    anchors, depths = [a0], [torch.zeros_like(a0)]
    seeds = a0[supervised(a0, torch.zeros_like(a0), doc, lmask)]
    prev = a0
    sizes = cod_sizes(len(seeds), K, r, r_min)
    for d in range(1, K):
        cand = prev[supervised(prev, torch.full_like(prev, d), doc, lmask)]
        if not full:
            size = sizes[d - 1]
            if size <= 0 or len(cand) == 0:
                break
            if len(cand) > size:
                pick = torch.randperm(len(cand), generator=gen, device=cand.device)[:size]
                cand = cand[pick.sort().values]
        if len(cand) == 0:
            break
        anchors.append(cand)
        depths.append(torch.full_like(cand, d))
        prev = cand
    return torch.cat(anchors), torch.cat(depths)
