"""Attention masks for drafter training, built from a table pre-computed once for the longest length.

P-EAGLE rule (element = (anchor a, depth d) of document doc[a]): query (aq, dq) may attend key (ak, dk) iff
    same document and [ (dk == 0 and ak <= aq)  or  (ak == aq and dk <= dq) ]
i.e. the real context up to its anchor plus the shallower slots of its own rollout (the inference view).
With every element of the row in depth-major order the full mask is a K x K grid of n x n blocks holding
only two distinct blocks: the document-causal block C (ak <= aq, same doc) for dk == 0 and the identity
for 0 < dk <= dq.  So the table pre-computed once is the causal triangle for the longest length; each row
slices C = tri[:n, :n] & same-doc out of it, and a (COD-subsampled, or partition-segment) element list
gathers its mask from C: no per-step mask construction beyond a gather.
"""
from __future__ import annotations

import torch


class MaskTable:
    def __init__(self, max_len: int, device="cpu"):
        self.max_len = max_len
        self.tri = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()

    def _grow(self, n):
        if n > self.max_len:
            self.__init__(max(n, 2 * self.max_len), self.tri.device)

    def doc_causal(self, doc: torch.Tensor) -> torch.Tensor:
        """C [n, n]: key anchor <= query anchor within the same document (sliced from the table)."""
        n = doc.shape[0]
        self._grow(n)
        return self.tri[:n, :n] & (doc[:, None] == doc[None, :])

    def peagle(self, C: torch.Tensor, qa, qd, ka=None, kd=None, chunk: int = 4096) -> torch.Tensor:
        """Mask [Eq, Ek] for query elements (qa, qd) over key elements (ka, kd) (default: the same list)."""
        if ka is None:
            ka, kd = qa, qd
        out = torch.empty(qa.shape[0], ka.shape[0], dtype=torch.bool, device=C.device)
        k0 = (kd == 0)[None, :]
        for s in range(0, qa.shape[0], chunk):  # row chunks bound the temporaries
            a, d = qa[s:s + chunk], qd[s:s + chunk]
            ctx = C[a][:, ka] & k0
            own = (a[:, None] == ka[None, :]) & (kd[None, :] <= d[:, None])
            out[s:s + chunk] = ctx | own
        return out

    def eagle3(self, C: torch.Tensor, k: int) -> torch.Tensor:
        """TTT step k (0-based): queries = all elements at step k, keys = steps 0..k concatenated.
        Step-0 keys causally (document-causal), step-j keys (1 <= j <= k) only at the same index
        (the diagonal extension)."""
        n = C.shape[0]
        eye = torch.eye(n, dtype=torch.bool, device=C.device)
        return torch.cat([C] + [eye] * k, 1)
