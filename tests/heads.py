"""Tiny random drafter heads for a tiny target (random heads reject most drafts: tests check identity)."""
from __future__ import annotations

import json
import os

import torch

from peagle.models.drafter import DrafterHead


def head_config(target_dir, layers=1, parallel=True, draft_vocab=None, aux=None):
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    L = t["num_hidden_layers"]
    cfg = dict(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_hidden_layers=layers,
               num_attention_heads=t["num_attention_heads"], num_key_value_heads=t.get("num_key_value_heads"),
               head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"], rms_norm_eps=1e-5,
               rope_theta=10000.0, max_position_embeddings=t["max_position_embeddings"], vocab_size=t["vocab_size"],
               draft_vocab_size=draft_vocab or t["vocab_size"], target_hidden_size=t["hidden_size"],
               eagle_aux_hidden_state_layer_ids=aux or [1, L // 2, L - 1], norm_before_residual=False)
    if parallel:
        cfg.update(ptd_token_id=4, pard_token=4)
    return cfg


def save_random_head(target_dir, path, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = head_config(target_dir, **kw)
    h = DrafterHead(cfg)
    with torch.no_grad():
        for n, p in h.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        if cfg["draft_vocab_size"] < cfg["vocab_size"]:  # draft vocab = every other target id
            ids = torch.arange(cfg["draft_vocab_size"]) * 2
            h.d2t.copy_(ids - torch.arange(cfg["draft_vocab_size"]))
            h.t2d.zero_()
            h.t2d[ids] = True
    h.save_pretrained(path)
    return path
