"""Quantized linears: GGUF's blocks of 32 (Q4_0, Q4_1, Q8_0, llama.cpp's byte layout) kept as they are stored;
activations in float32 (q8, q4: weight-only) or quantized to 8 bits per block of 32 first (q8a8, q4a8:
llama.cpp's own arithmetic, integer dot products per block; peagle/csrc/quant_kernels.h says how).

Layout: a weight [out N, in K] is a uint8 tensor [N, K/32 * block bytes], row n = output channel n's blocks:
  Q4_0 (18 B): fp16 d, 16 B of nibbles; w[j] = d * (lo(q[j]) - 8), w[j+16] = d * (hi(q[j]) - 8)
  Q4_1 (20 B): fp16 d, fp16 m, 16 B of nibbles; w[j] = d * lo(q[j]) + m (one rounding), w[j+16] with hi
  Q8_0 (34 B): fp16 d, 32 int8; w[j] = d * q[j]
A CPU float32 target's projections take the same kernels as F32 (GGML type 0), packed by 8 (pack_f32: per
group of 8 outputs, per chunk of 8 inputs, the outputs' floats side by side; [ceil(N/8)*8, 4K] bytes).
`--quantization q8` quantizes a float checkpoint to Q8_0 at load, `q4` to Q4_1 (llama.cpp's reference
quantizers); a GGUF file's Q4_0/Q4_1/Q8_0 tensors are taken as stored (peagle/models/gguf_target.py).

Products (:func:`qmm`): through the C++ kernel at any row count (peagle/csrc/, each weight byte read once per call for
up to KERNEL_MAX_ROWS rows, more rows in passes of that many; batch-invariant: a row's result does not depend on
the other rows or their number, so a verify block of B x (K+1) rows computes what B plain steps do). Without
the extension (peagle/models/quant_ext.py) the torch fallback computes the same products from the same float
weights (bit-exact dequantization, summation order differs: equal to ~1e-6 relative), one row at a time up to
KERNEL_MAX_ROWS rows (batch-invariant), one float GEMM past them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from . import quant_ext

F32, Q4_0, Q4_1, Q8_0 = 0, 2, 3, 8                 # GGML's type ids
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}     # GGUF's quantized blocks (what a file keeps as stored)
KERNEL_BYTES = {**BLOCK_BYTES, F32: 128}         # what the kernels take: F32 rows as "blocks" of 32 floats
NAMES = {F32: "F32", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
QUANTIZATIONS = ("none", "q8", "q4", "q8a8", "q4a8")
FOR_QUANTIZATION = {"q8": Q8_0, "q4": Q4_1, "q8a8": Q8_0, "q4a8": Q4_1}   # what a float weight is quantized to at load
KERNEL_MAX_ROWS = 128   # rows per pass of a float-activation kernel product (csrc ROW_BLOCK); the fallback's
                        # products of more rows: one float GEMM


def check_quantization(q: str | None) -> str:
    from ..errors import PeagleError
    q = q or "none"
    if q not in QUANTIZATIONS:
        raise PeagleError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {q!r}")
    return q


def weights_of(q: str) -> str:
    """The weight format of a quantization: q4a8 -> q4 (its weights are q4's; only the activations differ)."""
    return q[:2] if q.endswith("a8") else q


def quantizes_activations(q: str) -> bool:
    """Whether a quantization quantizes the activations to 8 bits (q8a8, q4a8)."""
    return q.endswith("a8")


# ---- quantizers (llama.cpp's reference rules: quantize_row_q8_0_ref, quantize_row_q4_1_ref) -------------------

def _blocks(w: torch.Tensor) -> np.ndarray:
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"in-features {K} is not a multiple of {BLOCK}")
    return w.detach().float().cpu().numpy().reshape(N, K // BLOCK, BLOCK)


def _pack(parts: list[np.ndarray], N: int) -> torch.Tensor:
    """Concatenate per-block byte fields (each [N, nb, bytes]) into [N, nb * block bytes]."""
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, -1)).reshape(N, -1))


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    x = _blocks(w)
    amax = np.abs(x).max(-1, keepdims=True)
    d = amax / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    v = x * inv
    q = np.trunc(v + np.copysign(np.float32(0.5), v)).clip(-127, 127).astype(np.int8)   # roundf's half away from 0
    return _pack([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], w.shape[0])


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    x = _blocks(w)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    d = (hi - lo) / 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, ((x - lo) * inv + 0.5).astype(np.int32)).astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return _pack([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8), packed], w.shape[0])


def stored_rows(qtype: int, n: int) -> int:
    """Rows of a weight tensor of n outputs (F32: padded to a multiple of 8; peagle/csrc/quant_kernels.h's twin)."""
    return (n + 7) // 8 * 8 if qtype == F32 else n


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float -> F32 packed by 8 (peagle/csrc/quant_kernels.h), as bytes [ceil(N/8)*8, 4K]: per group of 8
    outputs (zero rows pad the last), per chunk of 8 inputs, the 8 outputs' floats side by side."""
    N, K = w.shape
    R = stored_rows(F32, N)
    p = torch.zeros(R, K, dtype=torch.float32)
    p[:N] = w.detach()
    return p.view(R // 8, 8, K // 8, 8).transpose(1, 2).contiguous().view(R, K).view(torch.uint8)


def unpack_f32(data: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """pack_f32's inverse: float32 [N, K]."""
    G = data.shape[0] // 8
    return data.view(torch.float32).view(G, K // 8, 8, 8).transpose(1, 2).reshape(G * 8, K)[:N]


def quantize(w: torch.Tensor, qtype: int) -> torch.Tensor:
    if qtype == F32:        # the float32 weights themselves, reordered (pack_f32)
        return pack_f32(w)
    if qtype == Q8_0:
        return quantize_q8_0(w)
    if qtype == Q4_1:
        return quantize_q4_1(w)
    raise ValueError(f"no quantizer for {NAMES.get(qtype, qtype)}")


# ---- dequantization (bit-exact with the kernels) ----------------------------------------------------------------

def dequantize_torch(data: torch.Tensor, qtype: int, N: int, K: int) -> torch.Tensor:
    """float32 [N, K]: the kernels' weights exactly (Q4_1's d*q+m in float64 is exact, then rounded once like
    the kernels' fused multiply-add); F32: the weights unpacked (unpack_f32)."""
    if qtype == F32:
        return unpack_f32(data, N, K)
    b = data.reshape(N, K // BLOCK, KERNEL_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).double()
    if qtype == Q8_0:
        return (d * b[..., 2:].contiguous().view(torch.int8).double()).float().reshape(N, K)
    off = 2 if qtype == Q4_0 else 4
    nib = b[..., off:off + 16]
    q = torch.cat([nib & 15, nib >> 4], -1).double()
    if qtype == Q4_0:
        return (d * (q - 8)).float().reshape(N, K)
    m = b[..., 2:4].contiguous().view(torch.float16).double()
    return (d * q + m).float().reshape(N, K)


def dequantize(data: torch.Tensor, qtype: int, N: int, K: int) -> torch.Tensor:
    ext = quant_ext.get()
    if ext is not None and data.device.type == "cpu" and qtype != F32:
        return ext.dequantize(data.contiguous(), qtype, N, K)
    return dequantize_torch(data, qtype, N, K)


class QuantWeight:
    """A projection's weight [out, in] in GGUF blocks (see the module docstring), or float32 (F32, packed by 8:
    pack_f32; a CPU float32 target's projections through the same kernels); `mm` in layers.py takes it like a layers.Weight.
    `shape` is [in, out] as Weight's (its io layout)."""
    __slots__ = ("data", "qtype", "n", "k", "_dense", "act8", "_packed")
    quantized = True

    def __init__(self, data: torch.Tensor, qtype: int, n: int, k: int, act8: bool = False):
        if qtype not in KERNEL_BYTES or (act8 and qtype == F32):
            raise ValueError(f"unsupported block type {qtype}" + (" with 8-bit activations" if act8 else ""))
        if k % BLOCK or tuple(data.shape) != (stored_rows(qtype, n), k // BLOCK * KERNEL_BYTES[qtype]):
            raise ValueError(f"{NAMES[qtype]} data of shape {tuple(data.shape)} is not a [{n}, {k}] weight")
        self.data, self.qtype, self.n, self.k = data.contiguous(), qtype, n, k
        self._dense = None
        self._packed = None
        self.act8 = act8              # products quantize the activations to 8 bits first (qmm)

    @classmethod
    def from_float(cls, w: torch.Tensor, qtype: int, act8: bool = False) -> "QuantWeight":
        """w [out, in] float, quantized now."""
        return cls(quantize(w, qtype), qtype, *w.shape, act8=act8)

    @property
    def shape(self):
        return torch.Size((self.k, self.n))

    @property
    def dtype(self):
        return torch.float32

    @property
    def device(self):
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dense(self) -> torch.Tensor:
        """float32 [out, in], recomputed each call (cached only on the fallback path, see _fallback_dense)."""
        return dequantize(self.data, self.qtype, self.n, self.k)

    def packed_a8(self, ext) -> torch.Tensor:
        """The blocks reordered so that a vector lane is an output (peagle/csrc/quant_kernels.h, pack_a8), made once:
        what the a8 products' vector paths and the AVX-512 path of the float-activation ones read."""
        if self._packed is None:
            self._packed = ext.pack_a8(self.data, self.qtype, self.n, self.k)
        return self._packed

    def kernel_packed(self, ext) -> torch.Tensor:
        """packed_a8 where a kernel path reads it (8-bit activations; block types with float activations on an
        AVX-512 CPU), else an empty tensor (F32, or float activations without AVX-512: only the GGUF blocks)."""
        if self.act8 or (self.qtype != F32 and ext.has_avx512()):
            return self.packed_a8(ext)
        return torch.empty(0, dtype=torch.uint8)

    def _fallback_dense(self) -> torch.Tensor:
        if self._dense is None:      # no kernel: decode would dequantize every weight every step otherwise
            self._dense = dequantize_torch(self.data, self.qtype, self.n, self.k)
        return self._dense

    def to(self, *args, **kwargs) -> "QuantWeight":
        dev = next((a for a in args if isinstance(a, (str, torch.device))), kwargs.get("device"))
        if dev is None or torch.device(dev) == self.device:
            return self
        return QuantWeight(self.data.to(dev), self.qtype, self.n, self.k, self.act8)

    def __repr__(self):
        return f"QuantWeight({NAMES[self.qtype]}, out={self.n}, in={self.k})"


class QuantStack:
    """Projections stacked by output whose blocks differ in type (e.g. a GGUF file's q/k in Q4_1, v in Q8_0): each
    part's product, concatenated."""
    __slots__ = ("parts",)
    quantized = True

    def __init__(self, parts: list):
        self.parts = list(parts)

    @property
    def shape(self):
        return torch.Size((self.parts[0].k, sum(p.n for p in self.parts)))

    @property
    def dtype(self):
        return torch.float32

    @property
    def device(self):
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts])


def quant_cat(parts: list):
    """QuantWeights stacked by output (q, k, v -> qkv): one QuantWeight when their block types agree (Q4_0 is
    rewritten as Q4_1 with m = -8d where it meets Q4_1: the same weights bit for bit), else a QuantStack."""
    if len(parts) == 1:
        return parts[0]
    types = {p.qtype for p in parts}
    if types == {Q4_0, Q4_1}:
        parts = [q4_0_as_q4_1(p) if p.qtype == Q4_0 else p for p in parts]
        types = {Q4_1}
    if len(types) > 1 or len({p.k for p in parts}) > 1:
        return QuantStack(parts)
    return QuantWeight(torch.cat([p.data for p in parts]), parts[0].qtype, sum(p.n for p in parts), parts[0].k)


def q4_0_as_q4_1(w: QuantWeight) -> QuantWeight:
    """d * (q - 8) == fma(d, q, -8d) exactly (both products are exact in float32; -8d is exact in fp16 short of
    overflow)."""
    b = w.data.reshape(w.n, -1, 18)
    d = b[..., 0:2].contiguous().view(torch.float16)
    m = (d.float() * -8).half()
    if not torch.isfinite(m).all():
        raise ValueError("a Q4_0 scale too large to rewrite as Q4_1")
    out = torch.cat([b[..., 0:2], m.view(torch.uint8), b[..., 2:]], -1).reshape(w.n, -1)
    return QuantWeight(out, Q4_1, w.n, w.k)


def quantize_act_torch(x: torch.Tensor) -> tuple:
    """x [M, K] float32 -> (xq int8 [M, K], xd [M, K/32]): the extension's quantize_act (amax / 127 per block,
    round half to even, clamp to +-127), in torch."""
    M, K = x.shape
    b = x.reshape(M, K // BLOCK, BLOCK)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d >= torch.finfo(torch.float32).tiny, 1.0 / d, torch.zeros_like(d))   # 1/d finite
    q = torch.round(b * inv[..., None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(M, K), d


def _act8_dense(x2: torch.Tensor) -> torch.Tensor:
    """The activations an a8 product multiplies, as float32 [M, K] (xq * xd: exact)."""
    q, d = quantize_act_torch(x2)
    return (q.float().reshape(d.shape[0], -1, BLOCK) * d[..., None]).reshape(x2.shape)


def qmm(x: torch.Tensor, w, impl: int = 0) -> torch.Tensor:
    """x [..., K] float32 @ W^T -> [..., N]. impl (tests): 0 best kernel, 1 scalar, 2 AVX2, 3 AVX-512, 4 AMX (see
    peagle/csrc/ops.h), -1 the torch fallback. A weight with act8 multiplies the activations quantized to 8 bits (llama.cpp's)."""
    if isinstance(w, QuantStack):
        return torch.cat([qmm(x, p, impl) for p in w.parts], -1)
    rows = x.numel() // x.shape[-1]
    ext = quant_ext.get() if impl >= 0 else None
    x = x if x.dtype == torch.float32 else x.float()
    # the kernel at any row count (no unpacked copy kept; the kernel takes its rows in passes)
    if rows > KERNEL_MAX_ROWS and not (ext is not None and x.device.type == "cpu"):
        xd = _act8_dense(x.reshape(rows, w.k)).view(x.shape) if w.act8 else x
        return F.linear(xd, w.dense() if ext is not None else w._fallback_dense())
    if ext is not None and x.device.type == "cpu":
        if w.act8:
            return ext.qlinear_a8(x, w.data, w.packed_a8(ext), w.qtype, w.n, w.k, impl)
        return ext.qlinear(x, w.data, w.qtype, w.n, w.k, impl, w.kernel_packed(ext))
    # fallback: one row at a time (the same matrix-vector product whatever the batch: batch-invariant)
    W = w._fallback_dense()
    x2 = x.reshape(rows, w.k)
    if w.act8:
        x2 = _act8_dense(x2)
    y = torch.empty(rows, w.n, dtype=torch.float32, device=x.device)
    for r in range(rows):
        y[r] = torch.mv(W, x2[r])
    return y.view(*x.shape[:-1], w.n)


def layer_stack(ws: list, norms: list, nh: int, nkv: int, hd: int, eps: float, impl: int = 0):
    """The extension's C++ layer runner (peagle/csrc/forward.cpp) over ws, 4 projections per layer (qkv, o, gate_up,
    down), and norms (ln1, ln2 per layer, then the final norm): SimpleNamespace(run: the LayerStack, act8: whether
    its products quantize the activations), or None where it does not apply (no extension, a projection not in
    GGUF blocks, mixed activation kinds, a head size the exact attention does not take). impl: the paths (tests)."""
    ext = quant_ext.get()
    if ext is None or not hasattr(ext, "LayerStack") or not ws or hd % 8 \
            or not all(isinstance(w, QuantWeight) for w in ws) or len({w.act8 for w in ws}) != 1:
        return None
    act8 = ws[0].act8
    run = ext.LayerStack([w.data for w in ws], [w.kernel_packed(ext) for w in ws], act8, [w.qtype for w in ws],
                         [n.detach().float().contiguous() for n in norms], nh, nkv, hd, eps, impl)
    return SimpleNamespace(run=run, act8=act8)


# the KV cache element types the extension's kernels read and write (a bfloat16 cache: widened exactly on load)
EXT_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def runner_takes(stack, cache) -> bool:
    """Whether a layer_stack() runs a block over `cache` (its products take any row count): the
    cache must be allocated (its first write is the Python loop's), all float32 or all bfloat16."""
    return all(k is not None and k.dtype == cache.k[0].dtype for k in cache.k) and \
        cache.k[0].dtype in EXT_CACHE_DTYPES


# ---- fused small ops (the extension's, else torch) ---------------------------------------------------------------

def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + h, rms_norm(x + h) * weight)."""
    ext = quant_ext.get()
    if ext is not None and x.device.type == "cpu" and x.dtype == torch.float32 and h.dtype == torch.float32:
        return tuple(ext.add_rms_norm(x, h, weight, eps))
    s = x + h
    return s, F.rms_norm(s, (s.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight in one op (the extension's: add_rms_norm's sums; else torch's)."""
    ext = quant_ext.get()
    if ext is not None and hasattr(ext, "rms_norm") and x.device.type == "cpu" and x.dtype == torch.float32 \
            and weight.dtype == torch.float32:
        return ext.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gu[..., :I]) * gu[..., I:]."""
    ext = quant_ext.get()
    if ext is not None and gu.device.type == "cpu" and gu.dtype == torch.float32:
        return ext.silu_mul(gu)
    i = gu.shape[-1] // 2
    return F.silu(gu[..., :i]) * gu[..., i:]


def attend_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 impl: int = 0) -> torch.Tensor | None:
    """q [B,T,nh,hd], k/v [B,nkv,S,hd], mask None or bool [B|1,1,T,S] -> [B,T,nh*hd]: attention with every
    query's sums in one fixed order (peagle/csrc/attend_impl.h), so a query's output has the same bits alone, in a
    verify block of any length, in a tree or next to other rows; SDPA's do not (its blocking follows T and S),
    which 8-bit activations turn into different tokens. k/v float32 or bfloat16 (a bfloat16 KV cache: each value
    widened exactly, so the bits of a float32 cache holding the same values). None where the extension is missing
    (the caller runs SDPA: then outputs agree only up to float rounding)."""
    ext = quant_ext.get()
    if ext is None or not hasattr(ext, "attend_exact") or q.device.type != "cpu" or q.dtype != torch.float32 \
            or q.shape[-1] % 8:
        return None
    return ext.attend_exact(q, k, v, mask, q.shape[-1] ** -0.5, impl)


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, b0: int, pos: torch.Tensor,
            nh: int, nkv: int) -> torch.Tensor | None:
    """RoPE of q and k and the k/v write into `cache` (layer, rows b0.., positions pos [B,T]) in one op: returns q
    rotated [B,T,nh,hd], the same bits as apply_rope + KVCache.write (a bfloat16 cache: k and v rounded to nearest
    even, as torch's copy). None where the extension's op does not apply
    (no extension, not float32 on the CPU): the caller runs the torch ops."""
    ext = quant_ext.get()
    kc, vc = cache.k[layer], cache.v[layer]
    if ext is None or not hasattr(ext, "rope_kv") or qkv.device.type != "cpu" or qkv.dtype != torch.float32 \
            or kc is None or kc.dtype not in EXT_CACHE_DTYPES or not qkv.is_contiguous():
        return None
    return ext.rope_kv(qkv, cos, sin, kc, vc, b0, pos, nh, nkv)
