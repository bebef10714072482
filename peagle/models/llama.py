"""Native Llama-family target (Llama, Mistral, Qwen2, Qwen3): loads an HF directory without transformers'
modeling code, runs a block of new tokens per row over a KV cache and returns the auxiliary hidden states
EAGLE-3 drafters read (id i = residual stream entering layer i = HF hidden_states[i]) from the same forward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..errors import PeagleError
from . import kernel_choice
from .config import ModelConfig
from .files import iter_safetensors, safetensors_files
from .layers import BlockCtx, Rope, Weight, cached_attention, calibrate_layout, mm, rms_norm, swiglu
from .quant import (
    F32,
    FOR_QUANTIZATION,
    KERNEL_MAX_ROWS,
    NAMES,
    Q8_0,
    QuantWeight,
    add_rms_norm,
    check_quantization,
    layer_stack,
    quant_cat,
    quantizes_activations,
    runner_takes,
    silu_mul,
    weights_of,
)

F32_KERNEL = True       # CPU float32 targets run their projections through peagle's kernel (F32 rows; False: torch's
                        # MKL / oneDNN products, for A/B runs: lab/measure/cpu_step.py)
EXACT_MAX_T = 65        # weight-only quantized targets: fixed-order attention up to this block length (a tree's
                        # 64 nodes + root; a longer block is a prompt's prefill, the same for plain and speculative)


def load_safetensors(path: str, dtype: torch.dtype, prefix_strip: str = "") -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (sharded or not), floating point ones cast to dtype."""
    files = safetensors_files(path)
    if not files:
        raise PeagleError(f"no *.safetensors weights in {path}")
    return {(k[len(prefix_strip):] if k.startswith(prefix_strip) else k): (t.to(dtype) if t.is_floating_point() else t)
            for k, t in iter_safetensors(files)}


def check_shapes(cfg: ModelConfig, weights: dict, quants: dict) -> None:
    """PeagleError naming the first layer tensor whose shape is not the config's, or layers past
    num_hidden_layers (a config that does not describe these weights: wrong outputs or a kernel's error later)."""
    H, hd, inter, L = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    want = {"self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
            "self_attn.o_proj.weight": (H, q), "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
            "mlp.down_proj.weight": (H, inter), "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    for i in range(L):
        for suffix, shape in want.items():
            name = f"model.layers.{i}.{suffix}"
            got = (quants[name].n, quants[name].k) if name in quants else \
                tuple(weights[name].shape) if name in weights else None
            if got is not None and got != shape:
                raise PeagleError(f"{name} has shape {list(got)}, the config says {list(shape)} (hidden_size {H}, "
                                  f"heads {cfg.num_attention_heads} / {cfg.num_key_value_heads} x head_dim {hd}, "
                                  f"intermediate_size {inter}): the config does not describe these weights")
    layers = {int(n.split(".")[2]) for n in (*weights, *quants) if n.startswith("model.layers.")}
    if layers and max(layers) >= L:
        raise PeagleError(f"the weights hold {max(layers) + 1} layers, the config's num_hidden_layers is {L}")


class Layer:
    def __init__(self, w: dict, i: int, cfg: ModelConfig, dual: bool = False, lin=None):
        """lin(names) -> the projection of those tensors stacked by output (quantized targets: Transformer._linear);
        default: a layers.Weight."""
        p = f"model.layers.{i}."
        g = lambda n: w[p + n]
        lin = lin or (lambda names: Weight(torch.cat([w[n] for n in names]), dual))
        # weights in the layouts of layers.Weight ([in, out], plus [out, in] where several-row products need it)
        self.qkv_w = lin([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"])
        self.qkv_b = (torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias")])
                      if cfg.qkv_bias else None)
        self.o_w = lin([p + "self_attn.o_proj.weight"])
        self.o_b = g("self_attn.o_proj.bias") if cfg.o_bias else None
        self.q_norm = g("self_attn.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = g("self_attn.k_norm.weight") if cfg.qk_norm else None
        self.ln1 = g("input_layernorm.weight")
        self.ln2 = g("post_attention_layernorm.weight")
        self.gate_up = lin([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        self.down = lin([p + "mlp.down_proj.weight"])


class Transformer:
    """Target model. forward() appends a [B,T] block of tokens per row to the cache and returns logits."""

    backend = "native"

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=torch.float32, device="cpu", layout: str = "auto",
                 quantization: str = "none", quants: dict | None = None, source: str | None = None):
        """layout: "auto" (keep [out, in] copies where they measure faster here, see layers.Weight), "dual", "io".
        quantization: "none" (float weights), "q8" / "q4" (weight-only, peagle/models/quant.py; "q8a8" / "q4a8":
        the same weights, activations quantized to 8 bits in every product, llama.cpp's arithmetic): the projections
        in `quants` (QuantWeights by HF name, a GGUF file's blocks as stored) are used as they are, the other
        float projections quantized now (q8: Q8_0, q4: Q4_1; the LM head Q8_0 in both, as llama.cpp keeps it).
        The embedding, norms and `lm_head` stay float32 (lookups, drafters, final_logits).
        none on the CPU in float32 with peagle's C++ kernels (F32_KERNEL): the projections as F32 rows through the
        same batch-invariant kernels and layer runner as q8 / q4 (one pass over each weight per step, any row
        count summed in one order); elsewhere torch's products (layers.Weight)."""
        from . import quant_ext
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.kv_dtype = dtype       # the KV cache's element type (loader.load_target's kv_cache_dtype)
        self.quantization = check_quantization(quantization)
        self.f32_kernel = (self.quantization == "none" and F32_KERNEL and self.device.type == "cpu"
                           and dtype == torch.float32 and quant_ext.get() is not None)
        quants = {} if self.quantization == "none" else (quants or {})
        check_shapes(cfg, weights, quants)
        if self.quantization != "none" and (dtype != torch.float32 or self.device.type != "cpu"):
            raise PeagleError(f"--quantization {self.quantization} runs on the CPU in float32 (got {self.device.type}, "
                              f"{str(dtype).replace('torch.', '')})")
        try:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in quants and name not in weights:
                    weights = {**weights, name: quants[name].dense()}
            self.embed = weights["model.embed_tokens.weight"]
            self.norm = weights["model.norm.weight"]
            head = self.embed if cfg.tie_word_embeddings else weights.get("lm_head.weight", self.embed)
            self.lm_head = head
            # both layouts first; the [out, in] copies are dropped again where they do not pay (layers.Weight)
            dual = layout == "dual" or (layout == "auto" and self.device.type == "cpu" and dtype == torch.float32)
            if self.quantization == "none" and not self.f32_kernel:
                self.lm_head_t = Weight(head, dual)                  # oi is the [V, H] matrix itself (no copy)
                self.layers = [Layer(weights, i, cfg, dual) for i in range(cfg.num_hidden_layers)]
            else:
                hq = "model.embed_tokens.weight" if (cfg.tie_word_embeddings or "lm_head.weight" not in weights) \
                    else "lm_head.weight"
                self.lm_head_t = self._linear(weights, quants, [hq], F32 if self.f32_kernel else Q8_0)
                qt = F32 if self.f32_kernel else FOR_QUANTIZATION[self.quantization]
                self.layers = [Layer(weights, i, cfg, lin=lambda names: self._linear(weights, quants, names, qt))
                               for i in range(cfg.num_hidden_layers)]
        except KeyError as e:
            raise PeagleError(f"weights are missing tensor {e.args[0]!r}") from None
        if self.embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise PeagleError(f"embed_tokens shape {tuple(self.embed.shape)} does not match config "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.fused = self.exact_attention = False
        self.runner, self._stack = True, None     # runner: the C++ layer runner where it applies (_layer_stack)
        self.exact_max_t = None                   # blocks longer than this attend through SDPA (None: no limit)
        self.kernel_paths = None                  # impl 0's AVX-512 thresholds by kind (kernel_choice), if any
        if self.quantization != "none" or self.f32_kernel:
            # a token's bits must not depend on its block (plain step, verify block, tree) or its batch: the
            # kernels are row-invariant, and attention is summed in one fixed order per query (SDPA's blocking
            # follows T and S). 8-bit activations would turn SDPA's last-bit differences into other tokens, so
            # a8 targets attend exactly in every block; weight-only ones in decode-sized blocks (SDPA's is ~3x
            # faster on a long prompt, which the engine prefills alone so that its block does not depend on
            # the prompts admitted with it: Engine._prefill_forward).
            self.exact_attention = True
            self.exact_max_t = EXACT_MAX_T
            if quantizes_activations(self.quantization):
                if quant_ext.get() is None or cfg.head_dim % 8:
                    raise PeagleError(f"--quantization {self.quantization} needs peagle's C++ kernels ("
                                      f"{quant_ext.why_not() or 'head_dim ' + str(cfg.head_dim) + ' is no multiple of 8'}"
                                      "): without them its outputs would not be exact; use q4 / q8")
                self.exact_max_t = None
                for w in self._projections():
                    for p in getattr(w, "parts", None) or [w]:
                        if hasattr(p, "act8"):
                            p.act8 = True
            self.fused = True                # add + RMSNorm and SiLU * mul in one op each (quant.add_rms_norm)
            self.kernel_paths = kernel_choice.ensure(self._projections())   # AVX2 / AVX-512 by rows, timed here
            self.layout_gain = self._calibrate_heads_layout() if dual else 1.0
            self.dual_layout = layout == "dual" or (dual and self.layout_gain > 1.25)
            self.precision = self._describe(source)
        else:
            self.layout_gain = calibrate_layout([L.gate_up for L in self.layers]) if dual else 1.0
            self.dual_layout = layout == "dual" or (dual and self.layout_gain > 1.25)
            self.precision = f"{str(dtype).replace('torch.', '')} weights"
        if self.quantization == "none" and not self.f32_kernel and dual and not self.dual_layout:
            for w in [self.lm_head_t] + [getattr(L, n) for L in self.layers for n in ("qkv_w", "o_w", "gate_up", "down")]:
                w.single()
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings + 64,
                         dtype, device)
        self.nq = cfg.num_attention_heads * cfg.head_dim
        self.nkv = cfg.num_key_value_heads * cfg.head_dim

    def _linear(self, weights: dict, quants: dict, names: list, qtype: int):
        """The projection of tensors `names` stacked by output: their blocks as stored where all are quantized
        (quant.quant_cat), else the float tensors quantized to qtype now (a width that is no multiple of 32
        stays float32)."""
        if all(n in quants for n in names):
            return quant_cat([quants[n] for n in names])
        w = torch.cat([quants[n].dense() if n in quants else weights[n] for n in names])
        if w.shape[1] % 32:
            return Weight(w, False)
        return QuantWeight.from_float(w, qtype)

    def _projections(self) -> list:
        return [self.lm_head_t] + [getattr(L, n) for L in self.layers for n in ("qkv_w", "o_w", "gate_up", "down")]

    def _calibrate_heads_layout(self) -> float:
        """The float layout choice drafter heads follow (`dual_layout`), measured on float copies of a few layers'
        gate_up weights (a quantized target itself has no float projections to measure)."""
        ws = [L.gate_up for L in self.layers[:4]]
        ws = [Weight(w.dense() if hasattr(w, "dense") else w.io.t(), True) for w in ws]
        return calibrate_layout(ws)

    def _describe(self, source: str | None) -> str:
        from collections import Counter

        from . import quant_ext
        c = Counter()
        for w in self._projections():
            for p in getattr(w, "parts", None) or [w]:
                c[NAMES[p.qtype] if hasattr(p, "qtype") else "float32"] += 1
        nbytes = sum(getattr(w, "nbytes", 0) for w in self._projections())
        where = f" (blocks of {source} as stored where quantized)" if source else ""
        counts = ", ".join(f"{k} x{n}" for k, n in sorted(c.items()))
        paths = f" ({kernel_choice.summary(self.kernel_paths)}, as timed here)" if self.kernel_paths else ""
        return (f"quantization {self.quantization}: projections {counts}{where}, {nbytes / 1e6:.1f} MB read per "
                f"step; {quant_ext.describe()}{paths}; products in passes of up to {KERNEL_MAX_ROWS} rows")

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu", layout: str = "auto",
                        quantization: str = "none") -> "Transformer":
        """An HF directory, or a GGUF file (path ending in .gguf). A directory converted from a GGUF file peagle
        can find (gguf_target.source_gguf: the default target) runs that file's blocks under the quantization of
        their kind (q4 / q4a8 for Q4_0 / Q4_1 projections, q8 / q8a8 for Q8_0 ones)."""
        from .gguf_target import block_family, source_gguf
        quantization = check_quantization(quantization)
        if path.endswith(".gguf"):
            return cls.from_gguf(path, dtype, device, layout, quantization)
        cfg = ModelConfig.from_dir(path)
        src = source_gguf(path) if quantization != "none" else None
        if src is not None and block_family(src) == weights_of(quantization):     # its blocks: what auto says
            return cls.from_gguf(src, dtype, device, layout, quantization, cfg)
        return cls(cfg, {k: v.to(device) for k, v in load_safetensors(path, dtype).items()}, dtype, device, layout,
                   quantization)

    @classmethod
    def from_gguf(cls, path: str, dtype=torch.float32, device="cpu", layout: str = "auto",
                  quantization: str = "none", cfg: ModelConfig | None = None) -> "Transformer":
        """A GGUF file (peagle/models/gguf_target.py): with quantization q8/q4 its Q4_0/Q4_1/Q8_0 tensors are
        used as stored, without dequantizing; with none everything is read as float32."""
        import os

        from .gguf_target import read_gguf
        quantization = check_quantization(quantization)
        raw, floats, quants = read_gguf(path, keep_blocks=quantization != "none", cfg=cfg.raw if cfg else None)
        cfg = cfg or ModelConfig.from_dict(raw)
        floats = {k: v.to(device, dtype) for k, v in floats.items()}
        return cls(cfg, floats, dtype, device, layout, quantization, quants,
                   source=os.path.basename(path) if quants else None)

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, rows,
                       self.kv_dtype, self.device)

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
        if self.kernel_paths:
            kernel_choice.activate(self.kernel_paths)   # another target of this process may have set others
        tokens, start = tokens.to(dev), start.to(dev)
        ctx = BlockCtx(self.rope, start, T, b0, span, s0, cache.max_len, c.sliding_window)
        if tree is not None:
            tree.apply(ctx, self.rope, c.sliding_window)
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = F.embedding(tokens, self.embed)
        if self.fused:
            return self._forward_fused(x, ctx, cache, aux_ids, logits_at)
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

    def _forward_fused(self, x, ctx, cache, aux_ids, logits_at):
        """forward's layers with each residual add and the RMSNorm after it as one op, SiLU * mul as one
        (quant.add_rms_norm, quant.silu_mul: the C++ extension's, else torch's)."""
        c = self.cfg
        nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        aux, n = [], len(self.layers)
        exact = self.exact_attention and (self.exact_max_t is None or x.shape[1] <= self.exact_max_t)
        stack = self._layer_stack() if exact else None
        if stack is not None and runner_takes(stack, cache):
            cache.reserve(ctx.S)
            h, a = stack.run.forward(x, cache.k, cache.v, ctx.cos, ctx.sin, ctx.pos_w, ctx.mask, ctx.b0, ctx.S,
                                     list(aux_ids))
            if logits_at is not None:
                h = h[torch.arange(h.shape[0], device=h.device), logits_at.to(h.device)]
            return mm(h, self.lm_head_t).float(), (a if a.shape[-1] else None)
        _, h = add_rms_norm(x, torch.zeros_like(x), self.layers[0].ln1 if n else self.norm, eps)
        for i, L in enumerate(self.layers):
            if i in aux_ids:
                aux.append(x)
            a = cached_attention(ctx, cache, i, mm(h, L.qkv_w, L.qkv_b), nh, nkv, hd, L.q_norm, L.k_norm, eps,
                                 fused=True, exact=exact)
            x, h = add_rms_norm(x, mm(a, L.o_w, L.o_b), L.ln2, eps)
            d = mm(silu_mul(mm(h, L.gate_up)), L.down)
            x, h = add_rms_norm(x, d, self.layers[i + 1].ln1 if i + 1 < n else self.norm, eps)
        if n in aux_ids:
            aux.append(x)
        if logits_at is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_at.to(h.device)]
        return mm(h, self.lm_head_t).float(), (torch.cat(aux, -1) if aux else None)

    def _layer_stack(self):
        """The C++ runner of the layers (peagle/csrc/forward.cpp: the same ops as the loop of _forward_fused, one call
        per forward), made once; None where it does not apply (no extension, runner off, a float or mixed-type
        projection, biases, q/k norms). Its `act8` says whether products quantize the activations."""
        if self._stack is None:
            self._stack = _target_stack(self) or False          # False: made, and it does not apply
        return self._stack if self._stack and self.runner else None

    @torch.no_grad()
    def final_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits over vocabulary ids `rows` (all if None) from final residuals h (aux id L)."""
        w = self.lm_head if rows is None else self.lm_head[rows]
        return F.linear(rms_norm(h.to(self.device).float(), self.norm.float(), self.cfg.rms_norm_eps), w.float())


def _target_stack(t: Transformer, impl: int = 0):
    """quant.layer_stack over the target's layers, or None where the runner does not apply (biases, q/k norms,
    or what layer_stack refuses). impl: the extension's paths (0 best for this CPU, 1 scalar, 2 AVX2, 3 AVX-512,
    4 AMX: tests)."""
    c = t.cfg
    if any(L.qkv_b is not None or L.o_b is not None or L.q_norm is not None for L in t.layers):
        return None                                          # biases, q/k norms: not the runner's ops
    return layer_stack([getattr(L, n) for L in t.layers for n in ("qkv_w", "o_w", "gate_up", "down")],
                       [n for L in t.layers for n in (L.ln1, L.ln2)] + [t.norm],
                       c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, impl)
