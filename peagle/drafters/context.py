"""The drafter's per-row context, owned by the proposer (peagle/drafters/base.py): for each engine row, the rows
the drafter still has to be fed -- tokens x_{q+1} with the target's auxiliary hidden states at q, for positions q
from the drafter's cached length on -- and how many there are. The next step that drafts feeds them all (one
padded block of B x max(behind)); a step without drafting (K = 0) appends its row instead, so the drafter falls
behind and catches up later.

Row map: row i belongs to engine.running[i], as the rows of both KV caches and of peagle/rowstate.py do; when a
request leaves, the last row moves into its place (Proposer.remove_row). Per row:
  ids     [rows, width]     the tokens x_{q+1} still to feed (the first `behind` real, the rest padding)
  aux     [rows, width, A]  the target's aux states at those positions q (None without aux layers)
  behind  list              how many are real, on the host (from the engine's one copy per step); the step
                            that drafts copies them to the device, as does a step without drafting whose
                            rows are uneven (no device copy is kept: a step without drafting updates only
                            this list)
The drafter's cached length is never stored: it is the target cache's length minus behind."""
from __future__ import annotations

import torch

from ..rowstate import grow_rows, grown


class DraftContext:
    def __init__(self, device, max_rows: int | None = None, max_width: int | None = None):
        """max_rows: rows never double past this (the engine's max_num_seqs); max_width: nor entries past this
        (the drafter cache's max_len: no row is longer)."""
        self.device = torch.device(device)
        self.rows = self.width = 0
        self.max_rows, self.max_width = max_rows, max_width
        self.ids = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.aux: torch.Tensor | None = None
        self.behind: list[int] = []

    def ensure(self, rows: int, width: int = 1, aux_dim: int | None = None, aux_dtype=None):
        """At least `rows` rows of `width` entries each, plus an aux buffer of width aux_dim when given (a
        different aux_dim starts a fresh one); existing contents are kept."""
        new_aux = aux_dim is not None and (self.aux is None or self.aux.shape[-1] != aux_dim)
        if rows <= self.rows and width <= self.width and not new_aux:
            return
        rows = grow_rows(self.rows, rows, self.max_rows) if rows > self.rows else self.rows
        # K = 0 steps grow the width by 1: doubled like the rows, up to the longest a row gets
        width = grow_rows(self.width, width, self.max_width) if width > self.width else self.width
        self.ids = grown(self.ids, (rows, width), self.device)
        if new_aux:
            self.aux = grown(None, (rows, width, aux_dim), self.device, aux_dtype)
        elif self.aux is not None:
            self.aux = grown(self.aux, (rows, width, self.aux.shape[-1]), self.device)
        self.rows, self.width = rows, width

    def move(self, src: int, dst: int):
        """Row src takes row dst's place (the request in dst has left)."""
        for t in (self.ids, self.aux):
            if t is not None:
                t[dst] = t[src]
        self.behind[dst] = self.behind[src]
