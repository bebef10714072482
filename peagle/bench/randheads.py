"""Random drafter heads of a target's shape (harness tests and timing when no trained head exists)."""
from __future__ import annotations

import json
import os

import torch


def mask_token_id(target_dir: str) -> int:
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target_dir)
        i = tok.convert_tokens_to_ids("<|mask|>")
        if isinstance(i, int) and i != tok.unk_token_id:
            return i
    except Exception:  # noqa: BLE001 - tiny models have no tokenizer
        pass
    return 4


def random_head(target_dir: str, path: str, parallel: bool = True, layers: int = 1, draft_vocab: int | None = None,
                seed: int = 0) -> str:
    from ..models.drafter import DrafterHead
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    L = t["num_hidden_layers"]
    cfg = dict(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_hidden_layers=layers,
               num_attention_heads=t["num_attention_heads"],
               num_key_value_heads=t.get("num_key_value_heads") or t["num_attention_heads"],
               head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"], rms_norm_eps=1e-5,
               rope_theta=float(t.get("rope_theta", 10000.0)), max_position_embeddings=t["max_position_embeddings"],
               vocab_size=t["vocab_size"], draft_vocab_size=draft_vocab or t["vocab_size"],
               target_hidden_size=t["hidden_size"], eagle_aux_hidden_state_layer_ids=[1, L // 2, L - 1],
               norm_before_residual=False)
    if parallel:
        m = mask_token_id(target_dir)
        cfg.update(ptd_token_id=m, pard_token=m)
    torch.manual_seed(seed)
    h = DrafterHead(cfg)
    with torch.no_grad():
        for _, p in h.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        if cfg["draft_vocab_size"] < cfg["vocab_size"]:
            ids = torch.arange(cfg["draft_vocab_size"])
            h.d2t.zero_()
            h.t2d.zero_()
            h.t2d[ids] = True
    h.save_pretrained(path)
    return path


def random_demo_target(path: str, seed: int = 0) -> str:
    """A random-weight model with the demo target's config (timing only, when models/demo-target is absent)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaForCausalLM
    from ..target.train import demo_config
    torch.manual_seed(seed)
    m = LlamaForCausalLM(demo_config()).eval()
    m.save_pretrained(path)
    return path


def target_or_random(model: str, scratch: str, log=print) -> str:
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    log(f"note: {model} not found: timing a RANDOM model of the demo target's shape instead")
    return random_demo_target(os.path.join(scratch, "random-demo-target"))


def head_or_random(head: str | None, target: str, scratch: str, parallel: bool, layers: int = 1, log=print) -> str:
    if head and os.path.isfile(os.path.join(head, "config.json")):
        return head
    p = os.path.join(scratch, f"random-{'peagle' if parallel else 'eagle3'}-{layers}l")
    log(f"note: head {head} not found: using a RANDOM {layers}-layer head of the target's width ({p})")
    return random_head(target, p, parallel=parallel, layers=layers)
