"""KV cache for speculative decoding: preallocated per layer on the run's device, rows with their own lengths,
block append, rollback to any length, and compact row moves for continuous batching.

Layout per layer: k, v = [rows, n_kv, cap, head_dim]. The engine keeps active requests in rows 0..B-1,
so attention reads a strided view (no gather). `max_len` is the longest a row may get; `cap` (allocated
positions) starts small and doubles on demand (`reserve`, called by every forward with its host-side span),
so memory and set-up follow the lengths in use, not the model's context (a 32-row SmolLM2 cache at its full
8,192 positions would be 12 GB, zero-filled before the first token); an idle engine gives back what its largest
batch grew (`release`, through Engine.release_memory: the server does after 30 s idle).

Lengths: `lens` [rows] (int64, on the cache's device) is the one record of how many positions of each row are
valid. The engine reads it as the start of a row's next block and writes it after verification, all on the
device (a cache built with lens=False -- the drafter's -- has none: its valid length is derived by the
engine, see peagle/engine.py). A forward never changes `lens`: it writes k/v for the block it was given.

Rollback: setting a row's length to n (`truncate`, or the engine's batched `lens[:B] = start + accepted + 1`)
is all a rollback takes. Entries at positions >= n are stale; they are never read because every query
attends only to keys at positions <= its own and the block that covers a position writes it before attending,
so the next block starting at n overwrites them. Attention reads a slice [0, span) with span any host-side
upper bound of (start + block length): keys between a row's own end and span are masked by position."""
from __future__ import annotations

import torch

from .rowstate import grow_rows


class KVCache:
    """n_kv / head_dim None: layers are allocated on their first write (``alloc``), each with its own shape
    (targets whose layers differ, e.g. Gemma 4's wider global layers; KV-shared layers never allocate)."""

    def __init__(self, n_layers, n_kv, head_dim, max_len, rows=1, dtype=torch.float32, device="cpu",
                 lens: bool = True, initial_len: int = 256):
        self.n_layers, self.n_kv, self.head_dim, self.max_len = n_layers, n_kv, head_dim, max_len
        self.initial_len = initial_len
        self.cap = min(max_len, initial_len)
        self.dtype, self.device = dtype, torch.device(device)
        self.rows = max(rows, 1)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.lens = torch.zeros(self.rows, dtype=torch.long, device=self.device) if lens else None
        if n_kv is not None:
            for i in range(n_layers):
                self.alloc(i, n_kv, head_dim)

    def alloc(self, layer: int, n_kv: int, head_dim: int):
        for store in (self.k, self.v):
            store[layer] = torch.zeros((self.rows, n_kv, self.cap, head_dim), dtype=self.dtype, device=self.device)

    def reserve(self, n: int):
        """At least n allocated positions (capped at max_len); grows by doubling, contents kept. The new
        positions are zeros: a masked key must hold a finite value (0 x NaN would leak through attention)."""
        if n <= self.cap:
            return
        cap = min(max(n, 2 * self.cap), self.max_len)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                if old is not None:
                    new = torch.zeros((*old.shape[:2], cap, old.shape[3]), dtype=self.dtype, device=self.device)
                    new[:, :, : self.cap] = old
                    store[i] = new
        self.cap = cap

    def release(self):
        """Back to one row of the initial capacity, zeros (no row in use: an idle engine gives back what its
        largest batch and longest row grew it to; the next requests grow it again)."""
        self.cap, self.rows = min(self.max_len, self.initial_len), 1
        for i, old in enumerate(self.k):
            if old is not None:
                self.alloc(i, old.shape[1], old.shape[3])
        if self.lens is not None:
            self.lens = torch.zeros(1, dtype=torch.long, device=self.device)

    def ensure_rows(self, n: int, limit: int | None = None):
        """Grow to at least n rows (existing rows are kept; rowstate.grow_rows)."""
        if n <= self.rows:
            return
        n = grow_rows(self.rows, n, limit)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                if old is not None:
                    new = torch.zeros((n, *old.shape[1:]), dtype=self.dtype, device=self.device)
                    new[: self.rows] = old
                    store[i] = new
        if self.lens is not None:
            lens = torch.zeros(n, dtype=torch.long, device=self.device)
            lens[: self.rows] = self.lens
            self.lens = lens
        self.rows = n

    def write(self, layer: int, b0: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k/v [B,T,n_kv,hd] for rows b0..b0+B-1 at absolute positions pos [B,T] (any per-row starts;
        the caller has reserved max(pos) + 1 positions)."""
        B, T = pos.shape
        kc, vc = self.k[layer], self.v[layer]
        n_kv, cap, hd = kc.shape[1:]
        # one index_copy_ over the flattened [rows * n_kv * cap, hd] store: advanced indexing with the head
        # slice in the middle (store[rows, :, pos] = k) takes a slow generic path
        heads = torch.arange(n_kv, device=pos.device)[None, :, None]                    # [1,n_kv,1]
        rows = torch.arange(b0, b0 + B, device=pos.device)[:, None, None]               # [B,1,1]
        flat = ((rows * n_kv + heads) * cap + pos[:, None, :]).reshape(-1)               # [B*n_kv*T]
        kc.view(-1, hd).index_copy_(0, flat, k.transpose(1, 2).reshape(-1, hd).to(kc.dtype))
        vc.view(-1, hd).index_copy_(0, flat, v.transpose(1, 2).reshape(-1, hd).to(vc.dtype))

    def write_at(self, layer: int, b0: int, s0: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v [B,T,n_kv,hd] for rows that all start at host position s0 (one contiguous slice copy)."""
        B, T = k.shape[:2]
        self.reserve(s0 + T)
        self.k[layer][b0:b0 + B, :, s0:s0 + T] = k.transpose(1, 2)
        self.v[layer][b0:b0 + B, :, s0:s0 + T] = v.transpose(1, 2)

    def view(self, layer: int, b0: int, B: int, S: int):
        self.reserve(S)
        return self.k[layer][b0:b0 + B, :, :S], self.v[layer][b0:b0 + B, :, :S]

    def truncate(self, row: int, n: int):
        """Roll one row back (or forward) to n valid positions; what lies beyond is stale (see the module doc)."""
        self.lens[row] = n

    def move_row(self, src: int, dst: int):
        """Copy row src into row dst (used to keep active rows compact when a request leaves)."""
        if src == dst:
            return
        for store in (self.k, self.v):
            for t in store:
                if t is not None:
                    t[dst].copy_(t[src])
        if self.lens is not None:
            self.lens[dst] = self.lens[src]
