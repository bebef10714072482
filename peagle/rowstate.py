"""The engine's per-row decoding state, on the device.

Row map: row i of these tensors, of the target's KV cache and of the drafter's (with the drafter's per-row
context, peagle/drafters/context.py) all belong to engine.running[i]; requests occupy rows 0..B-1 and when one
leaves, the last row moves into its place (`move`, mirrored by the caches' move_row). Per row:
  last       the sequence's last token (sampled, not yet in the target cache): the first token of the next
             verification block."""
from __future__ import annotations

import torch


class RowState:
    def __init__(self, device):
        self.device = torch.device(device)
        self.rows = 0
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)

    def ensure(self, rows: int, limit: int | None = None):
        """At least `rows` rows (doubling, not past limit); existing contents are kept."""
        if rows <= self.rows:
            return
        self.rows = grow_rows(self.rows, rows, limit)
        self.last = grown(self.last, (self.rows,), self.device)

    def move(self, src: int, dst: int):
        self.last[dst] = self.last[src]


def grow_rows(rows: int, n: int, limit: int | None = None) -> int:
    """The row count a buffer of `rows` rows grows to when it needs n > rows: doubling (few reallocations as
    requests arrive), but not past limit (the engine's max_num_seqs: a 65th row of 64 would allocate 128). The
    drafter's backlog grows its width the same way (limit: the longest a row gets)."""
    return max(n, min(2 * rows, limit or 2 * rows))


def grown(old, shape, device, dtype=None):
    """A zero buffer of `shape` holding `old` (None: none) in its leading corner."""
    new = torch.zeros(shape, dtype=dtype or old.dtype, device=device)
    if old is not None:
        new[tuple(slice(0, n) for n in old.shape)] = old
    return new
