"""Sequence partitioning for P-EAGLE (the paper's "gradient accumulation inside one sequence").

A packed row of n tokens has ~3.4n COD elements (K=8, r=0.7); one flat pass attends (3.4n)^2 pairs and
keeps all of it for backward.  Partitioning splits the row into segments of `seg_len` anchors:

* the depth-0 elements form an ordinary (document-)causal stream that never looks at deeper elements, so
  it is computed ONCE per row (graph retained: O(n * H * layers) memory) and its per-layer keys/values are
  the context every segment attends to ("the depth-0 context it needs, as keys/values only");
* segment s owns the elements whose anchor lies in [s*seg_len, (s+1)*seg_len) (every depth of a rollout
  stays in its anchor's segment); it runs its deep elements over [depth-0 keys | its own deep keys] with
  the mask rows of the pre-computed table, computes the logits of its owned supervised elements of every
  depth, and runs its own backward;
* every segment's loss is divided by the batch-wide count of supervised elements, so the sum of the
  segments' gradients equals the flat pass's gradient (tests/test_train_peagle.py checks <= 1e-5).

Peak memory is then dominated by one segment's deep elements x n keys instead of (3.4n)^2
(lab/studies/train_memory.py)."""
from __future__ import annotations

import torch


def owned_segments(anchor: torch.Tensor, seg_len: int):
    """Yields (segment index, owned [E] bool) for every non-empty segment."""
    if anchor.numel() == 0:
        return
    seg = anchor // seg_len
    for s in range(int(seg.max()) + 1):
        own = seg == s
        if bool(own.any()):
            yield s, own
