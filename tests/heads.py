"""Tiny random drafter heads for a tiny target (random heads reject most drafts: tests check identity)."""
from __future__ import annotations

from peagle.bench.randheads import random_head
from peagle.heads.config import HeadConfig
from peagle.heads.io import read_config

# The tiny targets mostly have no tokenizer, so the P-EAGLE mask token is given explicitly (tiny.py's
# tokenizer puts <|mask|> at this id too).
MASK = 4


def head_config(target_dir, layers=1, parallel=True, draft_vocab=None, aux=None) -> HeadConfig:
    return HeadConfig.for_target(read_config(target_dir), layers, draft_vocab, MASK if parallel else None, aux)


def save_random_head(target_dir, path, seed=0, parallel=True, **kw):
    return random_head(target_dir, path, parallel=parallel, seed=seed, mask_token=MASK if parallel else None, **kw)
