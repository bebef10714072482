"""Tiny random drafter heads for a tiny target (random heads reject most drafts: tests check identity)."""
from __future__ import annotations

from peagle.heads.config import HeadConfig
from peagle.heads.init import random_head
from peagle.models.config import ModelConfig
from peagle.models.files import read_config

# The tiny targets mostly have no tokenizer, so the P-EAGLE mask token is given explicitly (tiny.py's
# tokenizer puts <|mask|> at this id too).
MASK = 4


def head_config(target_dir, layers=1, parallel=True, draft_vocab=None, aux=None) -> HeadConfig:
    target = ModelConfig.describe(read_config(target_dir))
    return HeadConfig.for_target(target, layers, draft_vocab, MASK if parallel else None, aux)


def training_head(target_dir, layers=2, parallel=True, draft_vocab=256, seed=0):
    """A random drafter head with 2-D weights ~ N(0, 0.1) (large enough that the loss and gradients are not
    dominated by rounding), for the training tests."""
    import torch

    from peagle.heads.model import DrafterHead
    torch.manual_seed(seed)
    h = DrafterHead(head_config(target_dir, layers, parallel, draft_vocab))
    with torch.no_grad():
        for p in h.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return h


def save_random_head(target_dir, path, seed=0, parallel=True, **kw):
    return random_head(target_dir, path, parallel=parallel, seed=seed, mask_token=MASK if parallel else None, **kw)


def propose_capturing_logits(proposer, head, aux, x, m):
    """Prefill ``proposer`` with tokens x1..x_{m-1} (rows 0..m-2 of the target's ``aux`` states), then draft one
    step from the new token x_m at position m-1, capturing every ``head.draft_logits`` output on the way.
    Returns (drafts, captured logits): what the training forward must reproduce."""
    import torch

    from peagle.drafters.base import DraftBatch
    proposer.prefill(DraftBatch(x[:, 1:m], aux[:, : m - 1], torch.zeros(1, dtype=torch.long), torch.tensor([m - 1])))
    seen = []
    orig = head.draft_logits
    head.draft_logits = lambda h: seen.append(orig(h)) or seen[-1]
    try:
        drafts = proposer.propose(DraftBatch(x[:, m:m + 1], aux[:, m - 1:m], torch.tensor([m - 1]),
                                             torch.tensor([1])))
    finally:
        del head.draft_logits
    return drafts, seen


def random_target_states(target, aux_ids, n, seed):
    """A random token row x [1, n] (ids 5..499) and the target's aux hidden states over it [1, n, 3H]."""
    import torch
    x = torch.randint(5, 500, (1, n), generator=torch.Generator().manual_seed(seed))
    _, aux = target.forward(x, target.new_cache(1, n + 8), 0, torch.zeros(1, dtype=torch.long), aux_ids=aux_ids)
    return x, aux
