"""KV cache for speculative decoding: preallocated per layer, rows with their own lengths, block append,
rollback (truncate) to any length, and compact row moves for continuous batching.

Layout per layer: k, v = [rows, n_kv, max_len, head_dim]. The engine keeps active requests in rows
0..B-1, so attention reads a strided view (no gather). Entries past a row's length are stale and never
read: every query only attends to keys at positions <= its own, and those are always written first.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers, n_kv, head_dim, max_len, rows=1, dtype=torch.float32, device="cpu"):
        self.n_layers, self.n_kv, self.head_dim, self.max_len = n_layers, n_kv, head_dim, max_len
        self.dtype, self.device = dtype, device
        self.rows = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens = torch.zeros(0, dtype=torch.long)
        self.ensure_rows(rows)

    def ensure_rows(self, n: int):
        """Grow to at least n rows (existing rows are kept)."""
        if n <= self.rows:
            return
        n = max(n, 2 * self.rows)
        shape = (n, self.n_kv, self.max_len, self.head_dim)
        for store in (self.k, self.v):
            for i in range(self.n_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store and i < len(store):
                    new[: self.rows] = store[i]
                    store[i] = new
                else:
                    store.append(new)
        lens = torch.zeros(n, dtype=torch.long)
        lens[: self.rows] = self.lens
        self.lens, self.rows = lens, n

    def write(self, layer: int, b0: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k/v [B,T,n_kv,hd] for rows b0..b0+B-1 at absolute positions pos [B,T]."""
        B = pos.shape[0]
        rows = torch.arange(b0, b0 + B, device=pos.device)[:, None]
        self.k[layer][rows, :, pos] = k
        self.v[layer][rows, :, pos] = v

    def view(self, layer: int, b0: int, B: int, S: int):
        return self.k[layer][b0:b0 + B, :, :S], self.v[layer][b0:b0 + B, :, :S]

    def truncate(self, row: int, n: int):
        """Roll a row back to n tokens (what lies beyond is stale and will be overwritten)."""
        self.lens[row] = n

    def move_row(self, src: int, dst: int):
        """Copy row src into row dst (used to keep active rows compact when a request leaves)."""
        if src == dst:
            return
        for store in (self.k, self.v):
            for t in store:
                t[dst].copy_(t[src])
        self.lens[dst] = self.lens[src]
