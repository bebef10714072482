"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, attention over a KV cache, SwiGLU."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import quant_ext
from .quant import attend_exact, qmm, rope_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)      # one fused op on the hot path
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":  # same rule as Meta's / HF's llama3 rope
        factor = float(scaling["factor"])
        lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        mid = (wl >= high_wl) & (wl <= low_wl)
        return torch.where(mid, smoothed, out)
    raise ValueError(f"unsupported rope scaling {kind}")


class Rope:
    """cos/sin tables indexed by absolute position (HF's rotate-half convention), on the run's device.

    The tables cover max_pos positions; `ensure(n)` grows them from a host-side count. Looking positions up
    never reads them back to the host (the cached inference path calls ensure() with its host-side span).
    cos, sin [n, 1, hd] (a lookup is [..., 1, hd] as apply_rope broadcasts it); ar = 0..n-1 (int64), which a
    decode step's positions and mask are cut from instead of a new arange each (BlockCtx: fewer small ops on
    the hot path)."""

    def __init__(self, head_dim, theta, scaling, max_pos, dtype=torch.float32, device="cpu"):
        self.inv, self.dtype, self.device = rope_inv_freq(head_dim, theta, scaling), dtype, torch.device(device)
        self._build(max_pos)

    def _build(self, n):
        freqs = torch.outer(torch.arange(n, dtype=torch.float64, device="cpu"), self.inv)
        emb = torch.cat([freqs, freqs], -1)
        self.cos = emb.cos().to(self.device, self.dtype)[:, None]
        self.sin = emb.sin().to(self.device, self.dtype)[:, None]
        self.ar = torch.arange(n, device=self.device)

    @property
    def size(self) -> int:
        return self.cos.shape[0]

    def ensure(self, n: int):
        """Cover positions < n (a host int)."""
        if n > self.size:
            self._build(2 * n)

    def __call__(self, pos: torch.Tensor):
        return self.cos[pos], self.sin[pos]  # [...,T,1,hd]


def apply_rope(x, cos, sin):  # x [B,T,h,hd]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def causal_block_mask(start: torch.Tensor, T: int, S: int, window: int | None = None) -> torch.Tensor:
    """[B,1,T,S] bool: query i of row b (position q = start_b+i) sees keys p <= q, and with a sliding window
    only p > q - window (transformers' rule: the window counts the query itself)."""
    return mask_of(start[:, None] + torch.arange(T, device=start.device), torch.arange(S, device=start.device),
                   window)


def mask_of(pos: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """causal_block_mask from the queries' positions pos [B,T] and keys = 0..S-1: [B,1,T,S]."""
    qpos = pos[:, None, :, None]
    m = keys <= qpos
    if window is not None:
        m &= keys > qpos - window
    return m


def attend(q, k, v, mask):
    """q [B,T,nh,hd], k/v [B,nkv,S,hd] -> [B,T,nh*hd]. GQA via enable_gqa. k/v of a bfloat16 KV cache under a
    float32 q are widened (exactly) first."""
    B, T, nh, hd = q.shape
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                       enable_gqa=(k.shape[1] != nh))
    return o.transpose(1, 2).reshape(B, T, nh * hd)


class BlockCtx:
    """Per-forward facts shared by all layers of a pass over a KV cache: positions, rope, mask, write mode.

    start [B] (device) is where each row's block of T new tokens begins. The host-side facts that size the
    work come from the caller, so building a context never waits for the device:
      span: an upper bound of max(start) + T; attention reads keys [0, span) and the mask (built from start
            on the device) hides those past each query's own position, so any bound gives the same result
            (up to the order of floating-point sums).
      s0:   given when every row starts at host position s0: the block is written as one slice, and a
            one-token block with span == s0 + 1 needs no mask.
    Without span (callers off the hot path: tests, tools) both are read from start once, on the host.
    limit: the cache's length. Padding positions of a ragged block may run past it (a row with few real
    tokens next to one with many); they are written at limit - 1 instead, which no real query of that row
    sees (real positions stay below limit - 1: the engine sizes its caches so).
    window: a sliding window of every layer (Mistral); applied once span exceeds it."""

    def __init__(self, rope, start: torch.Tensor, T: int, b0: int = 0, span: int | None = None,
                 s0: int | None = None, limit: int | None = None, window: int | None = None):
        self.B, self.T, self.b0 = start.shape[0], T, b0
        if span is None:
            span = int(start.max()) + T
            s0 = int(start[0]) if bool((start == start[0]).all()) else None
        clamp = limit is not None and span > limit
        if clamp:
            span = limit
        rope.ensure(max(span, T))
        self.S, self.s0 = span, s0
        if window is not None and span <= window:
            window = None                                # no query has a key outside its window yet
        masked = not (s0 is not None and T == 1 and span == s0 + 1 and window is None)
        ext = quant_ext.get()
        if (ext is not None and hasattr(ext, "block_ctx") and start.device.type == "cpu" and start.dtype == torch.long
                and rope.cos.dtype == torch.float32):      # one call: after a step's weight stream ops are dear
            self.pos, self.pos_w, self.cos, self.sin, *mask = ext.block_ctx(
                start, T, span, limit - 1 if clamp else -1, -1 if window is None else window, masked, rope.cos, rope.sin)
            self.mask = mask[0] if masked else None
            return
        self.pos = start[:, None] + rope.ar[:T]
        self.pos_w = self.pos.clamp(max=limit - 1) if clamp else self.pos
        self.cos, self.sin = rope(self.pos_w)
        self.mask = mask_of(self.pos, rope.ar[:span], window) if masked else None


def cached_attention(ctx: BlockCtx, cache, layer: int, qkv: torch.Tensor, nh: int, nkv: int, hd: int,
                     q_norm=None, k_norm=None, eps=1e-6, fused: bool = False, exact: bool = False) -> torch.Tensor:
    """qkv [B,T,(nh+2nkv)*hd] -> attention output [B,T,nh*hd]; writes this block's k/v into the cache.
    fused: RoPE and the cache write in one op where the extension has it (quant.rope_kv: the same bits).
    exact: attention summed in one fixed order per query (quant.attend_exact: block- and batch-invariant)."""
    B, T = qkv.shape[:2]
    if fused and q_norm is None:
        cache.reserve(ctx.S)
        q = rope_kv(qkv, ctx.cos, ctx.sin, cache, layer, ctx.b0, ctx.pos_w, nh, nkv)
        if q is not None:
            kc, vc = cache.view(layer, ctx.b0, B, ctx.S)
            o = attend_exact(q, kc, vc, ctx.mask) if exact else None
            return attend(q, kc, vc, ctx.mask) if o is None else o
    qk = qkv[..., : (nh + nkv) * hd].view(B, T, nh + nkv, hd)
    v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd)
    if q_norm is not None:
        qk = torch.cat([rms_norm(qk[:, :, :nh], q_norm, eps), rms_norm(qk[:, :, nh:], k_norm, eps)], 2)
    qk = apply_rope(qk, ctx.cos, ctx.sin)                 # q and k heads rotated in one go
    q, k = qk[:, :, :nh], qk[:, :, nh:]
    cache.reserve(ctx.S)
    if ctx.s0 is not None:                               # contiguous slice write, no index_put
        cache.write_at(layer, ctx.b0, ctx.s0, k, v)
    else:
        cache.write(layer, ctx.b0, ctx.pos_w, k, v)
    kc, vc = cache.view(layer, ctx.b0, B, ctx.S)
    o = attend_exact(q.contiguous(), kc, vc, ctx.mask) if exact else None
    return attend(q, kc, vc, ctx.mask) if o is None else o


class Weight:
    """A projection's weight in the layouts this CPU runs fastest: `io` [in, out] (contiguous) always, and for
    products of several rows `oi` [out, in] for W @ x^T, plus oneDNN's packed layout of W (`pk`, CPU float32
    where torch has oneDNN) for PACK_MIN_ROWS rows or more. Measured on a 2-core AMD EPYC (AVX2, MKL), SmolLM2's
    60 [576, 3072] products: x @ W_io takes 30 ms for 1 row but 140-170 ms for 4-16 rows, W_oi @ x^T 33-70 ms
    for 2-16 rows but 65 ms for 1 row. A whole SmolLM2 forward with `pk` instead of `oi` (lab/measure/precision.py,
    min of 5, two runs): 8 requests x 1 token (batched decode) 1-18 % faster, 8 x 2 (a K = 1 verify at c=8)
    5-13 %, 1 x 16 14 %; but 1 x 4 tokens 21 % slower (14 % in a second check), so `pk` starts at 8 rows. So each product takes
    the fastest by its row count (up to OI_MAX_ROWS rows). `calibrate_layout` decides once per load whether the
    second copies pay."""
    __slots__ = ("io", "oi", "pk")

    def __init__(self, oi: torch.Tensor, dual: bool, io: torch.Tensor | None = None):
        self.io = oi.t().contiguous() if io is None else io
        self.oi = oi.contiguous() if dual else None
        self.pk = packed(oi) if dual else None

    @property
    def shape(self):
        return self.io.shape

    @property
    def dtype(self):
        return self.io.dtype

    @property
    def device(self):
        return self.io.device

    @property
    def dual(self) -> bool:
        return self.oi is not None or self.pk is not None

    def single(self):
        """Drop the few-row copy (it did not pay here)."""
        self.oi = self.pk = None

    def to(self, *args, **kwargs) -> "Weight":
        io = self.io.to(*args, **kwargs)
        return Weight(io.t(), self.dual, io=io)


OI_MAX_ROWS = 128      # above this (prefill), x @ W_io is as fast again and W_oi @ x^T needs a transposed copy
PACK = True            # keep oneDNN's packed weights where available (False: W_oi @ x^T only; for A/B runs)
PACK_MIN_ROWS = 8      # products of fewer rows take W_oi @ x^T (see Weight)


def packed(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of w [out, in] for x @ w^T, or None (not CPU float32, no oneDNN, or PACK off)."""
    if not (PACK and w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
    except (RuntimeError, AttributeError):
        return None


def mm(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T with W a Weight, or a tensor stored pre-transposed ([in, out], contiguous): on MKL, 1.3-2.5x
    faster than F.linear for the few-row products of decode and verification (M=8 x [1376,256] 151 -> 56 us).
    W may also be quantized (peagle/models/quant.py: QuantWeight, QuantStack)."""
    if getattr(w, "quantized", False):
        y = qmm(x, w)
    elif isinstance(w, Weight):
        rows = x.numel() // x.shape[-1]
        if PACK_MIN_ROWS <= rows <= OI_MAX_ROWS and w.pk is not None:   # several rows: oneDNN, packed weights
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), w.pk, None, "none", [], "")
            y = y.view(*x.shape[:-1], y.shape[-1])
        elif 1 < rows <= OI_MAX_ROWS and w.oi is not None:           # a few rows: W_oi @ x^T
            # [out, rows] -> row-major [rows, out] (a small copy): left column-major, every later op
            # inherits the strides and SDPA drops to its unfused kernel (SmolLM2 2-token verify 103 -> 81 ms)
            y = torch.mm(w.oi, x.reshape(-1, x.shape[-1]).t()).t().contiguous().view(*x.shape[:-1], w.oi.shape[0])
        else:
            y = torch.matmul(x, w.io)
    else:
        y = torch.matmul(x, w)
    return y if b is None else y + b


def calibrate_layout(weights: list, rows: int = 8, reps: int = 3) -> float:
    """How much faster products of `rows` rows run through the few-row copies (as mm takes them) than as
    x @ W_io, over a model's own weights (dual Weights), streamed from memory as a forward
    streams them (one cache-resident matrix measures another regime); min of reps. Only meaningful on the CPU
    in float32."""
    import time
    x = torch.randn(rows, weights[0].io.shape[0], dtype=weights[0].dtype, device=weights[0].device)

    def best(f):
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return min(ts)
    return best(lambda: [x @ w.io for w in weights]) / best(lambda: [mm(x, w) for w in weights])


def swiglu(x, gate_up_t, down_t, inter):
    """gate_up_t [H, 2I] and down_t [I, H], pre-transposed."""
    gu = mm(x, gate_up_t)
    return mm(F.silu(gu[..., :inter]) * gu[..., inter:], down_t)
