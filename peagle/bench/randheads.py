"""Random drafter heads of a target's shape (harness tests and timing when no trained head exists)."""
from __future__ import annotations

import os

import torch

from ..heads.config import HeadConfig, resolve_mask_token
from ..heads.io import read_config
from ..models.config import ModelConfig
from ..models.drafter import DrafterHead


def random_head(target_dir: str, path: str, parallel: bool = True, layers: int = 1, draft_vocab: int | None = None,
                seed: int = 0, aux=None, mask_token: int | None = None) -> str:
    """A random head of the target's shape saved at path (P-EAGLE: the mask token as given, else the target
    tokenizer's <|mask|>).  A draft vocabulary smaller than the target's is every (V // Vd)-th target id, so
    the draft->target map is not the identity."""
    mask = resolve_mask_token(target_dir, mask_token) if parallel else None
    hc = HeadConfig.for_target(ModelConfig.describe(read_config(target_dir)), layers, draft_vocab, mask, aux)
    torch.manual_seed(seed)
    h = DrafterHead(hc)
    with torch.no_grad():
        for _, p in h.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        V, Vd = hc.vocab_size, hc.draft_vocab_size
        if Vd < V:
            ids = torch.arange(Vd) * (V // Vd)
            h.d2t.copy_(ids - torch.arange(Vd))
            h.t2d.zero_()
            h.t2d[ids] = True
    h.save_pretrained(path)
    return path


def random_demo_target(path: str, seed: int = 0) -> str:
    """A random-weight model with the demo target's config (timing only, when models/demo-target is absent)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaForCausalLM

    from ..target.train import demo_config  # the demo target's trainer loads only when no demo target exists
    torch.manual_seed(seed)
    m = LlamaForCausalLM(demo_config()).eval()
    m.save_pretrained(path)
    return path


def target_or_random(model: str, scratch: str, log=print) -> str:
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    log(f"note: {model} not found: timing a RANDOM model of the demo target's shape instead")
    return random_demo_target(os.path.join(scratch, "random-demo-target"))


def head_or_random(head: str | None, target: str, scratch: str, parallel: bool, layers: int = 1,
                   mask_token: int | None = None, log=print) -> str:
    if head and os.path.isfile(os.path.join(head, "config.json")):
        return head
    p = os.path.join(scratch, f"random-{'peagle' if parallel else 'eagle3'}-{layers}l")
    log(f"note: head {head} not found: using a RANDOM {layers}-layer head of the target's width ({p})")
    return random_head(target, p, parallel=parallel, layers=layers, mask_token=mask_token)
