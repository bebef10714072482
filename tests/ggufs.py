"""A tiny llama written as a llama.cpp-style GGUF file (q/k rows permuted, projections quantized): what the
quantized-target, GGUF and attention tests load."""
import os

import numpy as np


def _permute(w, n_head, n_kv=None):   # llama.cpp's convert_hf_to_gguf permutation of q/k rows
    if n_kv is not None and n_head != n_kv:
        n_head = n_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(src_dir: str, path: str, types: dict, arch: str = "llama") -> None:
    """The tiny llama of src_dir as a llama.cpp-style GGUF: q/k rows permuted, projections quantized per
    `types` (HF suffix -> GGML type), norms F32. arch "qwen2": a Qwen2 (biases kept; llama.cpp permutes q/k
    rows for the llama architecture only)."""
    import gguf
    from safetensors.torch import load_file

    from peagle.models.config import ModelConfig
    cfg = ModelConfig.from_dir(src_dir)
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    from peagle.models.gguf_target import _LAYER
    for i in range(cfg.num_hidden_layers):
        for g, h in _LAYER.items():
            names[f"model.layers.{i}.{h}.weight"] = f"blk.{i}.{g}.weight"
            names[f"model.layers.{i}.{h}.bias"] = f"blk.{i}.{g}.bias"
    for hf, t in sd.items():
        a = t.float().numpy()
        if arch != "llama":
            pass
        elif ".q_proj." in hf:
            a = _permute(a, cfg.num_attention_heads)
        elif ".k_proj." in hf:
            a = _permute(a, cfg.num_attention_heads, cfg.num_key_value_heads)
        qt = next((v for k, v in types.items() if hf.endswith(k)), None) if a.ndim == 2 else None
        if qt is None:
            w.add_tensor(names[hf], np.ascontiguousarray(a))
        else:
            w.add_tensor(names[hf], gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_tiny_gguf(src_dir: str, path: str) -> str:
    """src_dir's tiny llama as a GGUF of every block type peagle reads: q/k Q4_0, v Q4_1 (so the fused qkv mixes
    them), o Q8_0, the MLP Q4_1 / Q4_0, the embedding and LM head Q8_0. Returns path."""
    import gguf
    T = gguf.GGMLQuantizationType
    write_tiny_gguf(src_dir, path, {"q_proj.weight": T.Q4_0, "k_proj.weight": T.Q4_0, "v_proj.weight": T.Q4_1,
                                    "o_proj.weight": T.Q8_0, "gate_proj.weight": T.Q4_1, "up_proj.weight": T.Q4_1,
                                    "down_proj.weight": T.Q4_0, "embed_tokens.weight": T.Q8_0,
                                    "lm_head.weight": T.Q8_0})
    return path
