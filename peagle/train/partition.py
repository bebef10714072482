"""Sequence partitioning for P-EAGLE: one packed row split into segments by anchor, each processed with its
own forward + backward.

Segment s owns the elements whose anchor lies in [s*L, (s+1)*L) (all depths: a rollout stays together).
Its forward also contains, as keys/values only, every depth-0 element with anchor < (s+1)*L (the real
context any owned element can see, plus the context those context elements see themselves: depth-0
attention is plain causal).  Each element's computation inside its segment is therefore identical to the
flat pass; the loss of segment s sums only over its owned supervised elements and is divided by the
row-batch-wide count, so the accumulated gradient equals the flat pass's gradient."""
from __future__ import annotations

import torch


def segments(anchor: torch.Tensor, depth: torch.Tensor, seg_len: int):
    """Yields (index [E_s] into the element list, owned [E_s] bool) per non-empty segment."""
    if seg_len <= 0 or anchor.numel() == 0:
        yield torch.arange(anchor.numel()), torch.ones(anchor.numel(), dtype=torch.bool)
        return
    seg = anchor // seg_len
    for s in range(int(seg.max()) + 1):
        own = seg == s
        if not bool(own.any()):
            continue
        end = (s + 1) * seg_len
        take = own | ((depth == 0) & (anchor < end))
        idx = take.nonzero().flatten()
        yield idx, own[idx]
