"""Native Llama-family target (Llama, Mistral, Qwen2, Qwen3): loads an HF directory without transformers'
modeling code, runs a block of new tokens per row over a KV cache and returns the auxiliary hidden states
EAGLE-3 drafters read (id i = residual stream entering layer i = HF hidden_states[i]) from the same forward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..errors import PeagleError
from .config import ModelConfig
from .files import iter_safetensors, safetensors_files
from .layers import BlockCtx, Rope, Weight, cached_attention, calibrate_layout, mm, rms_norm, swiglu


def load_safetensors(path: str, dtype: torch.dtype, prefix_strip: str = "") -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (sharded or not), floating point ones cast to dtype."""
    files = safetensors_files(path)
    if not files:
        raise PeagleError(f"no *.safetensors weights in {path}")
    return {(k[len(prefix_strip):] if k.startswith(prefix_strip) else k): (t.to(dtype) if t.is_floating_point() else t)
            for k, t in iter_safetensors(files)}


class Layer:
    def __init__(self, w: dict, i: int, cfg: ModelConfig, dual: bool = False):
        p = f"model.layers.{i}."
        g = lambda n: w[p + n]
        # weights in the layouts of layers.Weight ([in, out], plus [out, in] where several-row products need it)
        self.qkv_w = Weight(torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                                       g("self_attn.v_proj.weight")]), dual)
        self.qkv_b = (torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias")])
                      if cfg.qkv_bias else None)
        self.o_w = Weight(g("self_attn.o_proj.weight"), dual)
        self.o_b = g("self_attn.o_proj.bias") if cfg.o_bias else None
        self.q_norm = g("self_attn.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = g("self_attn.k_norm.weight") if cfg.qk_norm else None
        self.ln1 = g("input_layernorm.weight")
        self.ln2 = g("post_attention_layernorm.weight")
        self.gate_up = Weight(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]), dual)
        self.down = Weight(g("mlp.down_proj.weight"), dual)
        if cfg.mlp_bias:
            raise PeagleError("mlp_bias=true is not supported")


class Transformer:
    """Target model. forward() appends a [B,T] block of tokens per row to the cache and returns logits."""

    backend = "native"

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=torch.float32, device="cpu", layout: str = "auto"):
        """layout: "auto" (keep [out, in] copies where they measure faster here, see layers.Weight), "dual", "io"."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        try:
            self.embed = weights["model.embed_tokens.weight"]
            self.norm = weights["model.norm.weight"]
            head = self.embed if cfg.tie_word_embeddings else weights.get("lm_head.weight", self.embed)
            self.lm_head = head
            # both layouts first; the [out, in] copies are dropped again where they do not pay (layers.Weight)
            dual = layout == "dual" or (layout == "auto" and self.device.type == "cpu" and dtype == torch.float32)
            self.lm_head_t = Weight(head, dual)                  # oi is the [V, H] matrix itself (no copy)
            self.layers = [Layer(weights, i, cfg, dual) for i in range(cfg.num_hidden_layers)]
        except KeyError as e:
            raise PeagleError(f"weights are missing tensor {e.args[0]!r}") from None
        if self.embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise PeagleError(f"embed_tokens shape {tuple(self.embed.shape)} does not match config "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.layout_gain = calibrate_layout([L.gate_up for L in self.layers]) if dual else 1.0
        self.dual_layout = layout == "dual" or (dual and self.layout_gain > 1.25)
        if dual and not self.dual_layout:
            for w in [self.lm_head_t] + [getattr(L, n) for L in self.layers for n in ("qkv_w", "o_w", "gate_up", "down")]:
                w.single()
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings + 64,
                         dtype, device)
        self.nq = cfg.num_attention_heads * cfg.head_dim
        self.nkv = cfg.num_key_value_heads * cfg.head_dim

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu", layout: str = "auto") -> "Transformer":
        cfg = ModelConfig.from_dir(path)
        return cls(cfg, {k: v.to(device) for k, v in load_safetensors(path, dtype).items()}, dtype, device, layout)

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, rows, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache, b0: int, start: torch.Tensor,
                aux_ids: tuple = (), logits_at: torch.Tensor | None = None, span: int | None = None,
                s0: int | None = None, tree=None):
        """tokens [B,T] for cache rows b0..b0+B-1, each row's block starting at position start[b] (tree: a
        peagle.tree.TreeAttn -- node positions and the tree mask; the block still fills slots start..start+T-1).
        span, s0: host-side facts about the positions (see layers.BlockCtx); the engine always passes span,
        so a forward never reads a device value back (without span, start is read once on the host).
        Returns (logits [B,T,V] or [B,V] at logits_at per row, aux [B,T,len(aux_ids)*H] or None).
        Does not change cache.lens: the caller sets lengths after deciding what to keep."""
        c = self.cfg
        B, T = tokens.shape
        dev = self.device
        tokens, start = tokens.to(dev), start.to(dev)
        ctx = BlockCtx(self.rope, start, T, b0, span, s0, cache.max_len, c.sliding_window)
        if tree is not None:
            tree.apply(ctx, self.rope, c.sliding_window)
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = F.embedding(tokens, self.embed)
        aux = []
        for i, L in enumerate(self.layers):
            if i in aux_ids:
                aux.append(x)
            qkv = mm(rms_norm(x, L.ln1, c.rms_norm_eps), L.qkv_w, L.qkv_b)
            a = cached_attention(ctx, cache, i, qkv, nh, nkv, hd, L.q_norm, L.k_norm, c.rms_norm_eps)
            x = x + mm(a, L.o_w, L.o_b)
            x = x + swiglu(rms_norm(x, L.ln2, c.rms_norm_eps), L.gate_up, L.down, c.intermediate_size)
        if len(self.layers) in aux_ids:
            aux.append(x)
        if logits_at is not None:
            x = x[torch.arange(B, device=dev), logits_at.to(dev)]
        logits = mm(rms_norm(x, self.norm, c.rms_norm_eps), self.lm_head_t)
        return logits.float(), (torch.cat(aux, -1) if aux else None)

    @torch.no_grad()
    def final_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits over vocabulary ids `rows` (all if None) from final residuals h (aux id L)."""
        w = self.lm_head if rows is None else self.lm_head[rows]
        return F.linear(rms_norm(h.to(self.device).float(), self.norm.float(), self.cfg.rms_norm_eps), w.float())
