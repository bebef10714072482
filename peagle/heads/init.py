"""A head's first weights: from the target (training from scratch), from a trained head (--init, or an
EAGLE-3 head starting a P-EAGLE one) or random (harness tests and timing when no trained head exists).

Invariants: every new head's config is a :class:`HeadConfig` (``HeadConfig.for_target`` or a trained
head's); the random generator is seeded here, so a head is a pure function of (config, seed, sources); the
draft vocabulary's maps (d2t, t2d) come from :func:`peagle.heads.vocab.mappings` only."""
from __future__ import annotations

import os

import torch

from ..errors import PeagleError
from ..models.config import ModelConfig
from ..models.files import read_config
from .config import HeadConfig, resolve_mask_token
from .model import DrafterHead
from .vocab import mappings


# ----------------------------------------------------------------------------------------- from the target
def init_head(cfg: dict, target, draft_ids: torch.Tensor, method: str, seed: int):
    torch.manual_seed(seed)
    head = DrafterHead(cfg)
    V = head.config.vocab_size
    d2t, t2d, _ = mappings(draft_ids, V)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        if head.embed_tokens.weight.shape == target.embed.shape:
            head.embed_tokens.weight.copy_(target.embed.float())
        if head.lm_head.weight.shape[1] == target.lm_head.shape[1]:
            head.lm_head.weight.copy_(target.lm_head[draft_ids].float())
            head.norm.weight.copy_(target.norm.float())
        if head.parallel:
            head.mask_hidden.normal_(0, 1.0)
    # EAGLE-3 keeps the target's embedding frozen; P-EAGLE trains it (the mask row must adapt)
    head.embed_tokens.weight.requires_grad_(method == "peagle")
    return head


# ----------------------------------------------------------------------------------------- from a trained head
def source_head(path: str, target, parallel: bool, flag: str):
    """A trained head of this target that a run starts from, and its draft vocabulary (target ids);
    refused when it is not of the kind ``flag`` needs."""
    src = DrafterHead.from_pretrained(path, target.cfg, target_embed=target.embed)
    if src.parallel != parallel:
        kind = lambda p: "a parallel (P-EAGLE)" if p else "an EAGLE-3"
        raise PeagleError(f"{flag} {path} is {kind(src.parallel)} head; {flag} needs {kind(parallel)} one")
    return src, torch.arange(src.config.draft_vocab_size) + src.d2t


def warm_start(path: str, target, method: str):
    """--init: an existing head (same target) to continue training from, with its config and draft vocabulary;
    the optimizer and schedule start fresh."""
    src, draft_ids = source_head(path, target, method == "peagle", f"--method {method} --init")
    return src, src.cfg, draft_ids


def from_eagle3(path: str, target, layers: int, mask_token: int):
    """--init-from-eagle3: a P-EAGLE head that starts as a trained EAGLE-3 head (same target): its fc, first
    layer, final norm, lm_head, embeddings and draft vocabulary are copied.  Extra layers start as identities
    on the residual stream (their output projections o_proj / down_proj are zero), so at step 0 the new head's
    depth-1 draft equals the EAGLE-3 head's; ``mask_hidden`` starts at zero (fc maps it to zero and the mask
    token's embedding alone marks the slot).  Returns (source head, config, draft ids)."""
    src, draft_ids = source_head(path, target, False, "--init-from-eagle3")
    hc = HeadConfig.from_dict({k: v for k, v in src.cfg.items() if k != "peagle"})  # its record is not ours
    hc.num_hidden_layers, hc.mask_token_id = layers, mask_token
    return src, hc.to_dict(), draft_ids


def load_eagle3_into(head, src) -> None:
    """Copy every tensor of ``src`` that ``head`` has with the same shape; zero the output projections of
    the layers ``src`` lacks and ``mask_hidden``."""
    own = head.state_dict()
    with torch.no_grad():
        for k, v in src.state_dict().items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v)
        for i in range(len(src.layers), len(head.layers)):
            for name, p in head.layers[i].named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()
        head.mask_hidden.zero_()


# ----------------------------------------------------------------------------------------- random
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


def head_or_random(head: str | None, target: str, scratch: str, parallel: bool, layers: int = 1,
                   mask_token: int | None = None, log=print) -> str:
    if head and os.path.isfile(os.path.join(head, "config.json")):
        return head
    p = os.path.join(scratch, f"random-{'peagle' if parallel else 'eagle3'}-{layers}l")
    log(f"note: head {head} not found: using a RANDOM {layers}-layer head of the target's width ({p})")
    return random_head(target, p, parallel=parallel, layers=layers, mask_token=mask_token)
