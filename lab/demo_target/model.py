"""The demo target's model: its shape (a small ``LlamaForCausalLM``, :func:`demo_config`) and a random-weight
model of that shape for timing when no trained demo target exists.

Invariant: the demo target's shape is written here only (its trainer, the random stand-in and studies read it
from here); loading this module loads neither the trainer nor its data pipeline."""
from __future__ import annotations

import os

from .tokenizer import EOS_ID, PAD_ID


def demo_config(vocab_size: int = 8192, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02,
    )
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    return cfg


def random_demo_target(path: str, seed: int = 0) -> str:
    """A random-weight model with the demo target's config (timing only, when models/demo-target is absent)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(demo_config()).eval()
    m.save_pretrained(path)
    return path


def target_or_random(model: str, scratch: str, log=print) -> str:
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    log(f"note: {model} not found: timing a RANDOM model of the demo target's shape instead")
    return random_demo_target(os.path.join(scratch, "random-demo-target"))
