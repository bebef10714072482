"""The engine's per-row decoding state, on the device, typed (what used to be a per-request tuple).

Row map: row i of these tensors, of the target's KV cache and of the drafter's KV cache all belong to
engine.running[i]; requests occupy rows 0..B-1 and when one leaves, the last row moves into its place
(`move`, mirrored by the caches' move_row). Per row:
  last       the sequence's last token (sampled, not yet in the target cache): the first token of the next
             verification block;
  draft_ids  the drafter rows the next step must add (tokens x_{q+1} for positions q = drafter start ...),
  draft_aux  the target's auxiliary hidden states at those positions q ([.., A], absent without aux layers),
  draft_n    how many of those rows are real (the rest is padding).
The drafter's valid length is never stored: it is the target cache's length minus draft_n (see
peagle/engine.py)."""
from __future__ import annotations

import torch


class RowState:
    def __init__(self, device):
        self.device = torch.device(device)
        self.rows = self.width = 0
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)
        self.draft_n = torch.zeros(0, dtype=torch.long, device=self.device)
        self.draft_ids = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.draft_aux: torch.Tensor | None = None

    def ensure(self, rows: int, width: int = 1, aux_dim: int | None = None, aux_dtype=None):
        """At least `rows` rows and `width` drafter rows each, plus an aux buffer of width aux_dim when given
        (a different aux_dim starts a fresh one); existing contents are kept."""
        new_aux = aux_dim is not None and (self.draft_aux is None or self.draft_aux.shape[-1] != aux_dim)
        if rows <= self.rows and width <= self.width and not new_aux:
            return
        rows = max(rows, 2 * self.rows) if rows > self.rows else self.rows
        width = max(width, 2 * self.width) if width > self.width else self.width  # K = 0 steps grow it by 1
        self.last = _grown(self.last, (rows,), self.device)
        self.draft_n = _grown(self.draft_n, (rows,), self.device)
        self.draft_ids = _grown(self.draft_ids, (rows, width), self.device)
        if new_aux:
            self.draft_aux = _grown(None, (rows, width, aux_dim), self.device, aux_dtype)
        elif self.draft_aux is not None:
            self.draft_aux = _grown(self.draft_aux, (rows, width, self.draft_aux.shape[-1]), self.device)
        self.rows, self.width = rows, width

    def move(self, src: int, dst: int):
        if src == dst:
            return
        for t in (self.last, self.draft_n, self.draft_ids, self.draft_aux):
            if t is not None:
                t[dst] = t[src]


def _grown(old, shape, device, dtype=None):
    new = torch.zeros(shape, dtype=dtype or old.dtype, device=device)
    if old is not None:
        new[tuple(slice(0, n) for n in old.shape)] = old
    return new
