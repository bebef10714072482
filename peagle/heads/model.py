"""The drafter head (EAGLE-3 and P-EAGLE share it), stored in vLLM's flat EAGLE-3 layout.

Module attribute names equal the tensor names vLLM loads (no `model.` prefix), so state_dict() is the file:
embed_tokens, fc [H,3T], layers.0 (attention input 2H = [input_layernorm(embed) || hidden_norm(h)]),
layers.i plain Llama layers, norm, lm_head [Vd,H], d2t, t2d, and mask_hidden [1,1,3T] for P-EAGLE."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import PeagleError
from ..models import quant as Q
from ..models.layers import BlockCtx, Rope, Weight, apply_rope, attend, cached_attention, mm, rms_norm, swiglu
from ..paths import missing_hint
from .config import HeadConfig, is_parallel_head
from .format import validate_head
from .io import load_head_dir, save_head_dir


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        # under autocast x is bfloat16: the weight in x's dtype keeps torch's fused kernel (mixed dtypes fall
        # back to ~6 elementwise ops)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim):
        super().__init__()
        nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.hd = hd

    def project(self, x):
        """The training path's q, k, v products of x (bfloat16 training runs them as one: train_linear)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def qkv(self, x, cos, sin):
        """Training path projections: q [B,T,nh,hd] (rotated), k/v [B,nkv,T,hd] (k rotated)."""
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q = apply_rope(q.view(B, T, -1, self.hd), cos, sin)
        k = apply_rope(k.view(B, T, -1, self.hd), cos, sin)
        return q, k.transpose(1, 2), v.view(B, T, -1, self.hd).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def project(self, x):
        """The gate and up products of x (bfloat16 training runs them as one: train_linear)."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x):
        g, u = self.project(x)
        return self.down_proj(F.silu(g) * u)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: HeadConfig, first: bool):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.first = first
        self.input_layernorm = RMSNorm(H, eps)
        if first:
            self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.norm_before_residual = bool(cfg.norm_before_residual)

    def attn_input(self, x, emb):
        """(residual, attention input): layer 0 attends over [input_layernorm(embed) || hidden_norm(h)]."""
        if self.first:
            hn = self.hidden_norm(x)
            return (hn if self.norm_before_residual else x), torch.cat([self.input_layernorm(emb), hn], -1)
        return x, self.input_layernorm(x)

    def forward(self, x, emb, cos, sin, attend_fn):
        """attend_fn(q, k, v) -> [B,T,nh*hd] decides what the block's queries see (mask, past keys, ...)."""
        resid, a_in = self.attn_input(x, emb)
        x = resid + self.self_attn.o_proj(attend_fn(*self.self_attn.qkv(a_in, cos, sin)))
        return x + self.mlp(self.post_attention_layernorm(x))


class DrafterHead(nn.Module):
    def __init__(self, cfg: HeadConfig | dict, parallel: bool | None = None):
        """parallel: build for parallel drafting (mask token + mask_hidden); None = what the config says."""
        super().__init__()
        # a copy (from_dict(to_dict())): the head owns its config, whatever the caller does with hers
        self.config = hc = HeadConfig.from_dict(cfg.to_dict() if isinstance(cfg, HeadConfig) else cfg)
        H, T3 = hc.hidden_size, 3 * hc.target_hidden_size
        self.embed_tokens = nn.Embedding(hc.vocab_size, H)
        self.fc = nn.Linear(T3, H, bias=False)
        self.layers = nn.ModuleList([DrafterLayer(hc, i == 0) for i in range(hc.num_hidden_layers)])
        self.norm = RMSNorm(H, hc.rms_norm_eps)
        self.lm_head = nn.Linear(H, hc.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(hc.vocab_size, dtype=torch.bool))
        self.mask_token_id = hc.mask_token_id if (hc.parallel if parallel is None else parallel) else None
        if self.parallel:
            self.mask_hidden = nn.Parameter(torch.randn(1, 1, T3) * 0.02)
        self.aux_ids = tuple(hc.eagle_aux_hidden_state_layer_ids)
        self.rope = None

    @property
    def cfg(self) -> dict:
        """The head's config.json (vLLM's flat layout, :meth:`HeadConfig.to_dict`): a fresh dict per call."""
        return self.config.to_dict()

    @property
    def parallel(self) -> bool:
        return self.mask_token_id is not None

    def _rope(self, device, dtype):
        if self.rope is None or self.rope.device != device or self.rope.dtype != dtype:
            c = self.config
            self.rope = Rope(c.head_dim, float(c.rope_theta), c.rope_scaling,
                             int(c.max_position_embeddings) + 64, dtype, device)
        return self.rope

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [.., 3T] -> drafter width H (vLLM: combine_hidden_states)."""
        if not self.training and getattr(self, "_fc_t", None) is not None and not torch.is_grad_enabled():
            return mm(aux, self._fc_t)
        return self.fc(aux)

    def forward(self, ids, hidden, pos, ctx_mask=None, cache=None, b0=0, start=None, span=None, s0=None):
        """ids [B,T], hidden [B,T,H] (fc'd target state or the drafter's own prenorm output), pos [B,T].
        Attention: over a KV cache (cache, b0, start: causal from each row's start; span/s0: host-side facts
        as in layers.BlockCtx; inference, fused weights from prepare_inference()) or an explicit bool
        ctx_mask [B|1, 1, T, T] over this block (training). Returns (normed, prenorm), both [B,T,H]."""
        if cache is not None:
            return self._forward_cached(ids, hidden, cache, b0, start, span, s0)
        return self.run_layers(ids, hidden, pos, lambda i: lambda q, k, v: attend(q, k, v, ctx_mask))

    def run_layers(self, ids, hidden, pos, attend_for_layer):
        """The training-path pass; attend_for_layer(i) gives layer i's attend_fn. Returns (normed, prenorm)."""
        rope = self._rope(hidden.device, hidden.dtype)
        rope.ensure(int(pos.max()) + 1)            # training path: one host read of the positions per pass
        cos, sin = rope(pos)
        emb = self.embed_tokens(ids)
        x = hidden
        for i, layer in enumerate(self.layers):
            x = layer(x, emb, cos, sin, attend_for_layer(i))
        return self.norm(x), x

    @torch.no_grad()
    def prepare_inference(self, dual: bool = False, quantization: str = "none"):
        """Fuse q/k/v and gate/up per layer for the cached inference path (call again after changing weights),
        in layers.Weight's layouts: dual (the target's choice, `dual_layout`) adds the [out, in] copies that
        products of a few rows (a P-EAGLE pass, EAGLE-3's catch-up rows) run fastest with on this CPU.
        quantization: the target's; with a quantized float32 CPU target the projections become Q8_0 blocks, with
        8-bit activations where the target's are (drafts only propose: outputs stay the target's)."""
        w0 = self.fc.weight
        q8 = quantization not in (None, "none") and w0.device.type == "cpu" and w0.dtype == torch.float32

        def weight(w):
            w = w.detach()
            if q8 and w.shape[1] % 32 == 0:
                return Q.QuantWeight.from_float(w, Q.Q8_0, act8=Q.quantizes_activations(quantization))
            return Weight(w, dual)
        self._fused = []
        for L in self.layers:
            a, m = L.self_attn, L.mlp
            self._fused.append(tuple(weight(w) for w in (
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight)))
        self._fc_t = weight(self.fc.weight)
        self._lm_head_t = weight(self.lm_head.weight)
        from ..models import quant_ext
        # quantized targets: the extension's fused small ops (drafts only propose, so the few last bits these
        # change cannot change an output; float targets keep the torch ops vLLM's parity checks measured)
        self._fused_ops = q8 and quant_ext.get() is not None and self.config.head_dim % 8 == 0
        # ... and its layers in the target's C++ runner (layer 0 reads its own 2H-wide input: h0)
        c = self.config
        self._stack = Q.layer_stack([w for f in self._fused for w in f],
                                    [n.weight for L in self.layers for n in (L.input_layernorm,
                                                                             L.post_attention_layernorm)]
                                    + [self.norm.weight], c.num_attention_heads, c.num_key_value_heads,
                                    c.head_dim, c.rms_norm_eps) if self._fused_ops else None
        # fc(mask_hidden) [H], the mask rows' hidden of every P-EAGLE pass (proposer and one-call pass alike)
        self.mask_h = self.combine(self.mask_hidden.reshape(1, -1))[0] if self.parallel else None
        self._pass = self._draft_pass(quant_ext.get()) if self._stack is not None else None
        return self

    def _draft_pass(self, ext):
        """The extension's one-call greedy pass (peagle/csrc/draft_pass.cpp) over this head's fused weights, or None
        where it does not apply (an older build, fc or the LM head not in GGUF blocks, an embedding not float32)."""
        fc, lm, emb = self._fc_t, self._lm_head_t, self.embed_tokens.weight
        if not hasattr(ext, "DraftHead") or not all(isinstance(w, Q.QuantWeight) for w in (fc, lm)) \
                or fc.act8 != lm.act8 or emb.dtype != torch.float32 or emb.device.type != "cpu":
            return None
        L0 = self.layers[0]
        mask_h = self.mask_h if self.parallel else torch.empty(0)
        return ext.DraftHead(fc.data, fc.kernel_packed(ext), fc.qtype, fc.k, lm.data, lm.kernel_packed(ext), lm.qtype,
                             lm.n, fc.act8, emb.detach().contiguous(), L0.input_layernorm.weight.detach().float(),
                             L0.hidden_norm.weight.detach().float(), self.config.rms_norm_eps,
                             bool(L0.norm_before_residual), mask_h.detach().float(),
                             -1 if self.mask_token_id is None else int(self.mask_token_id), self.d2t)

    @torch.no_grad()
    def greedy_pass(self, ids, hidden, n_mask, cache, b0, start, span, s0, first, fc=True):
        """One row's greedy drafter pass in one extension call: ids [1,T], hidden [1,T,3T] (fc false: [1,T,H], the
        drafter's own prenorm) and n_mask mask rows after them -> (drafts [1, W - first] in the target vocabulary, the
        argmax of the rows from `first` on; prenorm [1,W,H]), the same as _forward_cached + draft_logits + greedy +
        to_target; None where that call does not apply (the caller runs those)."""
        dp, stack = getattr(self, "_pass", None), getattr(self, "_stack", None)
        if dp is None or stack is None or not Q.runner_takes(stack, cache) or ids.device.type != "cpu":
            return None
        ctx = BlockCtx(self._rope(hidden.device, hidden.dtype), start, ids.shape[1] + n_mask, b0, span, s0,
                       cache.max_len)
        cache.reserve(ctx.S)
        return tuple(dp.pass_(stack.run, ids, hidden, n_mask, cache.k, cache.v, ctx.cos, ctx.sin, ctx.pos_w, ctx.mask,
                              ctx.b0, ctx.S, first, fc))

    @torch.no_grad()
    def _forward_cached(self, ids, hidden, cache, b0, start, span=None, s0=None, tree=None):
        """tree: a peagle.tree.TreeAttn (positions and a tree mask over the block's slots; EAGLE-2 expansion)."""
        if getattr(self, "_fused", None) is None:
            self.prepare_inference()
        c = self.config
        eps, nh, nkv = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads
        hd, inter = c.head_dim, c.intermediate_size
        rope = self._rope(hidden.device, hidden.dtype)
        ctx = BlockCtx(rope, start, ids.shape[1], b0, span, s0, cache.max_len)
        if tree is not None:
            tree.apply(ctx, rope)
        emb = F.embedding(ids, self.embed_tokens.weight)
        if getattr(self, "_fused_ops", False):
            return self._forward_cached_fused(emb, hidden, ctx, cache)
        x = hidden
        for i, (L, (qkv_w, o_w, gu_w, d_w)) in enumerate(zip(self.layers, self._fused)):
            resid, a_in = L.attn_input(x, emb)
            x = resid + mm(cached_attention(ctx, cache, i, mm(a_in, qkv_w), nh, nkv, hd), o_w)
            x = x + swiglu(rms_norm(x, L.post_attention_layernorm.weight, eps), gu_w, d_w, inter)
        return rms_norm(x, self.norm.weight, eps), x

    def _forward_cached_fused(self, emb, x, ctx, cache):
        """_forward_cached's layers with the extension's ops (quant.py): RoPE + cache write and exact attention in
        one op each, each residual add with the RMSNorm after it, SiLU * mul. Returns (normed, prenorm)."""
        c = self.config
        eps, nh, nkv, hd, n = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim, len(self.layers)
        L0 = self.layers[0]
        hn = Q.rms_norm(x, L0.hidden_norm.weight, eps)                # layer 0 attends over [norm(emb) || norm(h)]
        resid = hn if L0.norm_before_residual else x
        a_in = torch.cat([Q.rms_norm(emb, L0.input_layernorm.weight, eps), hn], -1)
        stack = getattr(self, "_stack", None)
        if stack is not None and Q.runner_takes(stack, cache):
            cache.reserve(ctx.S)
            return tuple(stack.run.forward(resid, cache.k, cache.v, ctx.cos, ctx.sin, ctx.pos_w, ctx.mask, ctx.b0,
                                          ctx.S, [n], a_in))
        for i, (L, (qkv_w, o_w, gu_w, d_w)) in enumerate(zip(self.layers, self._fused)):
            a = cached_attention(ctx, cache, i, mm(a_in, qkv_w), nh, nkv, hd, fused=True, exact=True)
            x, h = Q.add_rms_norm(resid, mm(a, o_w), L.post_attention_layernorm.weight, eps)
            nxt = self.layers[i + 1].input_layernorm.weight if i + 1 < n else self.norm.weight
            resid, a_in = Q.add_rms_norm(x, mm(Q.silu_mul(mm(h, gu_w)), d_w), nxt, eps)
        return a_in, resid

    def draft_logits(self, normed):
        if not self.training and getattr(self, "_lm_head_t", None) is not None and not torch.is_grad_enabled():
            return mm(normed, self._lm_head_t)
        return self.lm_head(normed)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- storage (vLLM flat EAGLE-3 layout) ----
    shares_target_embedding = False    # True: embed_tokens is the target's (frozen, not stored: vLLM shares it too)

    def save_pretrained(self, path: str, extra: dict | None = None):
        """The head directory vLLM loads (config keys sorted; ``extra`` adds keys such as the peagle record).
        A head that shares the target's embedding stores none (vLLM then uses the target's, as peagle does)."""
        cfg = HeadConfig.from_dict({**self.config.to_dict(), **(extra or {})}).to_dict()
        sd = self.state_dict()
        if self.shares_target_embedding:
            sd.pop("embed_tokens.weight")
        save_head_dir(path, cfg, sd, sort_keys=True)

    def share_embedding(self, embed: torch.Tensor) -> "DrafterHead":
        """Use the target's embedding [V, H] (frozen, the same storage when dtype and device match)."""
        if tuple(embed.shape) != tuple(self.embed_tokens.weight.shape):
            raise PeagleError(f"the target's embedding {tuple(embed.shape)} does not fit this head "
                              f"{tuple(self.embed_tokens.weight.shape)}")
        w = embed.to(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype)
        self.embed_tokens.weight = nn.Parameter(w, requires_grad=False)
        self.shares_target_embedding = True
        return self

    @classmethod
    def from_pretrained(cls, path: str, target_cfg=None, parallel: bool | None = None, dtype=torch.float32,
                        device="cpu", target_embed: torch.Tensor | None = None):
        """A validated head; parallel None = what the head is (:func:`peagle.heads.config.is_parallel_head`).
        target_embed: the target's embedding, for heads that store none (they share the target's)."""
        try:
            cfg, sd = load_head_dir(path)
        except (FileNotFoundError, OSError) as e:
            raise PeagleError(f"drafter head directory {path}: {e}{missing_hint(str(path))}") from None
        if parallel is None:
            parallel = is_parallel_head(cfg)
        errs = validate_head(cfg, sd, target_cfg.raw if target_cfg is not None else None, parallel)
        if errs:
            raise PeagleError(f"drafter head {path} does not fit: " + "; ".join(errs))
        head = cls(cfg, parallel)
        if not parallel:
            sd.pop("mask_hidden", None)
        missing, unexpected = head.load_state_dict(sd, strict=False)
        if head.config.draft_vocab_size == head.config.vocab_size:
            missing = [m for m in missing if m not in ("d2t", "t2d")]   # full vocabulary: identity map (vLLM 0.32
        shared = "embed_tokens.weight" in missing
        missing = [m for m in missing if m != "embed_tokens.weight"]
        if missing or unexpected:                                         # refuses d2t on such heads)
            raise PeagleError(f"drafter head {path}: missing tensors {missing}, unexpected tensors {unexpected}")
        head = head.to(device=device, dtype=dtype).eval()
        if shared:
            if target_embed is None:
                raise PeagleError(f"drafter head {path} stores no embedding (it shares the target's): load it "
                                  "with the target's embedding")
            head.share_embedding(target_embed)
        return head
