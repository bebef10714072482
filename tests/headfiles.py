"""Heads written as files for the format, export and import tests: a tiny config and random tensors of the
right shapes (make_config, make_tensors), a head directory (write_head, head) and a flat target directory with
only what export / import read (write_target)."""
import json
import os

import torch
from safetensors.torch import save_file

H, NH, NKV, HD, I, V, T_LAYERS, MAXPOS = 32, 4, 2, 8, 64, 96, 4, 1024
MASK = 5


def make_config(method="peagle", layers=2, draft_vocab=None, aux=(1, 2, 3), **over):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": HD, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAXPOS, "rope_theta": 10000.0, "vocab_size": V,
        "draft_vocab_size": draft_vocab or V, "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": list(aux), "norm_before_residual": False,
        "tie_word_embeddings": False, "eagle_config": {"use_aux_hidden_state": True},
        "peagle": {"method": method, "train_depths": 4},
    }
    if method == "peagle":
        cfg["ptd_token_id"] = cfg["pard_token"] = MASK
    cfg.update(over)
    return cfg


def make_tensors(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    Vd = cfg["draft_vocab_size"]
    ts = {"embed_tokens.weight": r(V, H), "fc.weight": r(H, 3 * H), "norm.weight": r(H), "lm_head.weight": r(Vd, H)}
    for i in range(cfg["num_hidden_layers"]):
        inp, p = (2 * H if i == 0 else H), f"layers.{i}."
        ts.update({p + "self_attn.q_proj.weight": r(NH * HD, inp), p + "self_attn.k_proj.weight": r(NKV * HD, inp),
                   p + "self_attn.v_proj.weight": r(NKV * HD, inp), p + "self_attn.o_proj.weight": r(H, NH * HD),
                   p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                   p + "mlp.down_proj.weight": r(H, I), p + "input_layernorm.weight": r(H),
                   p + "post_attention_layernorm.weight": r(H)})
        if i == 0:
            ts[p + "hidden_norm.weight"] = r(H)
    ids = torch.arange(Vd) * (V // Vd)  # every (V//Vd)-th target id
    ts["d2t"] = (ids - torch.arange(Vd)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    ts["t2d"] = t2d
    if cfg.get("peagle", {}).get("method") == "peagle":
        ts["mask_hidden"] = r(1, 1, 3 * H)
    return ts


def write_head(path, cfg, ts):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in ts.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def target_config(**over):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": T_LAYERS,
           "vocab_size": V, "max_position_embeddings": 1024, "num_attention_heads": NH, "intermediate_size": I}
    cfg.update(over)
    return cfg


def write_target(d, **over):
    """A target directory of target_config(**over) with its embedding and LM head (what export / import read)."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(target_config(**over), f)
    g = torch.Generator().manual_seed(7)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g),
               "lm_head.weight": torch.randn(V, H, generator=g)}, os.path.join(d, "model.safetensors"))
    return str(d)


def head(tmp_path, name="head", **kw):
    cfg = make_config(**kw)
    return write_head(tmp_path / name, cfg, make_tensors(cfg)), cfg


def same_tensors(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
