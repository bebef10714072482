"""Analytic "bigram" target and drafter heads for interop checks (see shared/research/vllm-cpu.md §3).

Target: a Llama whose o_proj and down_proj are zero, so every hidden state (and every aux state) equals the
embedding e_x of the current token; lm_head row y = 0.1 * e_{y-1}, so greedy decoding always emits x -> x+1.
Drafter: fc = [I | 0 | 0] selects the first aux chunk (e_x), its layers add nothing (o_proj/down_proj zero),
lm_head row y = 0.1 * e_{y-2}: it predicts x+2, the correct token for draft position 0.  Acceptance at
position 0 is therefore ~100 % only if the consumer wires embed/fc/aux ids/lm_head/d2t exactly right
(positions >= 1 would need a trained drafter and are expected ~0).

Runs in the project venv (transformers writes the target with save_pretrained); heads are written in
peagle's native layout with safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from peagle.heads.config import HeadConfig
from peagle.heads.io import save_head_dir

VOCAB = 2048
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
INTER = 512
MAX_POS = 512
AUX_IDS = [1, 2, 3]
MASK_TOKEN = 1


def build_target(out: str | Path, seed: int = 0) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=VOCAB - 1,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        emb = torch.randn(VOCAB, HIDDEN)
        emb = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1
        model.model.embed_tokens.weight.copy_(emb)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(0.1 * torch.roll(emb, 1, dims=0))  # row y = 0.1 e_{y-1}
    model.save_pretrained(str(out), safe_serialization=True)
    return json.loads((Path(out) / "config.json").read_text())


def target_embedding(target_dir: str | Path) -> torch.Tensor:
    from safetensors import safe_open

    for f in Path(target_dir).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith("embed_tokens.weight"):
                    return sf.get_tensor(k)
    raise FileNotFoundError("embed_tokens.weight not in target")


def head_config(method: str, layers: int = 1, draft_vocab: int | None = None, train_depths: int = 8) -> dict:
    return HeadConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, draft_vocab_size=draft_vocab or VOCAB, rms_norm_eps=1e-6,
        max_position_embeddings=MAX_POS, eagle_aux_hidden_state_layer_ids=list(AUX_IDS),
        mask_token_id=MASK_TOKEN if method == "peagle" else None,
        extra={"peagle": {"method": method, "train_depths": train_depths, "note": "analytic bigram drafter (test)"}},
    ).to_dict()


def build_head(out: str | Path, target_dir: str | Path, method: str = "peagle", layers: int = 1,
               draft_vocab: int | None = None, seed: int = 1) -> tuple[dict, dict]:
    """Native-layout bigram drafter. ``draft_vocab`` = VOCAB // 2 keeps only even target ids (tests d2t)."""
    g = torch.Generator().manual_seed(seed)
    emb = target_embedding(target_dir)
    H, I, hd = HIDDEN, INTER, HIDDEN // HEADS
    cfg = head_config(method, layers, draft_vocab)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    ts: dict[str, torch.Tensor] = {"embed_tokens.weight": emb.clone()}
    fc = torch.zeros(H, 3 * H)
    fc[:, :H] = torch.eye(H)
    ts["fc.weight"] = fc
    for i in range(layers):
        inp = 2 * H if i == 0 else H
        p = f"layers.{i}."
        ts[p + "self_attn.q_proj.weight"] = rnd(HEADS * hd, inp)
        ts[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * hd, inp)
        ts[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * hd, inp)
        ts[p + "self_attn.o_proj.weight"] = torch.zeros(H, HEADS * hd)
        ts[p + "mlp.gate_proj.weight"] = rnd(I, H)
        ts[p + "mlp.up_proj.weight"] = rnd(I, H)
        ts[p + "mlp.down_proj.weight"] = torch.zeros(H, I)
        ts[p + "input_layernorm.weight"] = torch.ones(H)
        ts[p + "post_attention_layernorm.weight"] = torch.ones(H)
        if i == 0:
            ts[p + "hidden_norm.weight"] = torch.ones(H)
    ts["norm.weight"] = torch.ones(H)
    pred = 0.1 * torch.roll(emb, 2, dims=0)  # row y = 0.1 e_{y-2}: x -> x+2
    if draft_vocab:
        tgt_ids = torch.arange(0, VOCAB, VOCAB // draft_vocab)[:draft_vocab]
        ts["lm_head.weight"] = pred[tgt_ids].clone()
        ts["d2t"] = (tgt_ids - torch.arange(draft_vocab)).to(torch.int64)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[tgt_ids] = True
        ts["t2d"] = t2d
    else:
        ts["lm_head.weight"] = pred.clone()
        ts["d2t"] = torch.zeros(VOCAB, dtype=torch.int64)
        ts["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    if method == "peagle":
        ts["mask_hidden"] = torch.zeros(1, 1, 3 * H)
    save_head_dir(out, cfg, ts)
    return cfg, ts


def bigram_next(x: int) -> int:
    return (x + 1) % VOCAB


def prompts(n: int = 4, seed: int = 0, min_len: int = 5, max_len: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append([int(t) for t in torch.randint(2, VOCAB - 1, (L,), generator=g)])
    return out
