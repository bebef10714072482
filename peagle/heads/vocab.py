"""Draft vocabulary: the top-N target tokens by frequency over the loss-masked (assistant) tokens, and the
maps a head stores for it (d2t, t2d; see peagle/heads/format.py)."""
from __future__ import annotations

import torch


def token_counts(docs, vocab_size: int) -> torch.Tensor:
    c = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in docs:
        c += torch.bincount(ids[mask.bool()], minlength=vocab_size)[:vocab_size]
    return c


def build_draft_vocab(counts: torch.Tensor, n: int, always: tuple = ()) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary (n == vocab size: identity).  Ties and unseen tokens are
    filled by lowest id (as speculators does).  `always` ids are forced in."""
    V = counts.shape[0]
    if n >= V:
        return torch.arange(V)
    score = counts.double().clone()
    score[list(always)] = float("inf")
    # stable: by count desc, then id asc
    order = sorted(range(V), key=lambda i: (-score[i].item(), i))[:n]
    return torch.tensor(sorted(order), dtype=torch.long)


def mappings(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> d2t [Vd] (target = draft + d2t[draft]), t2d bool [V], index [V] (target id -> draft id or -1)."""
    Vd = draft_ids.shape[0]
    d2t = draft_ids - torch.arange(Vd)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[draft_ids] = torch.arange(Vd)
    return d2t, t2d, index
