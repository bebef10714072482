"""The drafters' training attention in bfloat16: oneDNN / MKL products around a C++ softmax (on AVX-512 CPUs).

Invariant: ``masked_attention(q, k, v, mask)`` is softmax(q k^T * scale, hidden keys -inf) v with its gradients --
what ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`` computes -- and the tests hold both paths to a
float64 reference. Where it runs (bfloat16 q/k/v, the C++ extension with AVX-512): the scores q k^T and dP = dO v^T
in float32 products (as a flash kernel accumulates them), the softmax and its backward in one pass each
(csrc/train_attn_avx512.cpp), P and dS rounded to bfloat16 for the value, query and key products: the backward
is four products and a pass, where torch's CPU flash backward recomputes the scores block by block. Elsewhere
(float32, no AVX-512, no extension): torch's SDPA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

USE_KERNEL = True   # False: torch's SDPA everywhere (A/B runs, tests)
CAUSAL_CHUNK = 128  # queries per block of a causal document


def _kernel(q: torch.Tensor):
    """The extension when it runs this attention, else None."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or not USE_KERNEL:
        return None
    from ..models import quant_ext
    ext = quant_ext.get()
    return ext if ext is not None and ext.has_avx512() else None


class _MaskedAttention(torch.autograd.Function):
    """q [B,nh,T,hd], k/v [B,nkv,S,hd] bfloat16 (nh a multiple of nkv: head h reads kv head h // (nh/nkv)),
    mask [T,S] bool shared by every head -> [B,nh,T,hd]."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ext):
        B, nh, T, hd = q.shape
        nkv, S = k.shape[1], k.shape[2]
        scale = hd ** -0.5
        with torch.autocast("cpu", enabled=False):
            qg = q.reshape(B, nkv, nh // nkv * T, hd)                         # [B,nkv,g*T,hd], row = (head, t)
            kt = k.float().transpose(-1, -2).contiguous()                     # [B,nkv,hd,S]: MKL's fast layout
            s = torch.matmul(qg.float(), kt)                                  # [B,nkv,g*T,S] float32
            p, p16 = ext.attn_softmax_forward(s.view(-1, S), mask, scale)     # [R,S] float32 / bfloat16
            o = torch.matmul(p16.view(B, nkv, -1, S), v).view(B, nh, T, hd)
        ctx.save_for_backward(qg, k, v, p, p16)
        ctx.ext, ctx.scale = ext, scale
        return o

    @staticmethod
    def backward(ctx, do):
        qg, k, v, p, p16 = ctx.saved_tensors
        B, nkv, gT, hd = qg.shape
        S = k.shape[2]
        with torch.autocast("cpu", enabled=False):
            dog = do.to(torch.bfloat16).reshape(B, nkv, gT, hd)
            dv = torch.matmul(p16.view(B, nkv, gT, S).transpose(-1, -2), dog)           # [B,nkv,S,hd]
            dp = torch.matmul(dog.float(), v.float().transpose(-1, -2).contiguous())     # [B,nkv,g*T,S] float32
            ds = ctx.ext.attn_softmax_backward(dp.view(-1, S), p, ctx.scale).view(B, nkv, gT, S)
            dq = torch.matmul(ds, k).view(do.shape)                                      # [B,nh,T,hd]
            dk = torch.matmul(ds.transpose(-1, -2), qg)                                  # [B,nkv,S,hd]
        return dq, dk, dv, None, None


def masked_attention(q, k, v, mask):
    """q [B,nh,T,hd], k/v [B,nkv,S,hd] (GQA when nkv < nh), mask [T,S] bool (True = visible) -> [B,nh,T,hd]."""
    ext = _kernel(q)
    if ext is None or k.dtype != q.dtype or v.dtype != q.dtype or q.shape[2] == 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=k.shape[1] != q.shape[1])
    return _MaskedAttention.apply(q, k, v, mask.contiguous(), ext)


def causal_attention(q, k, v, chunk: int = CAUSAL_CHUNK):
    """One causal document: q [B,nh,n,hd], k/v [B,nkv,n,hd] -> [B,nh,n,hd]. With the kernel, queries in chunks
    of ``chunk``, each over the keys up to its last query (about half the masked square's pairs)."""
    n = q.shape[2]
    if _kernel(q) is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    tril = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    return torch.cat([masked_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], tril[a:b, :b])
                      for a, b in ((a, min(a + chunk, n)) for a in range(0, n, chunk))], 2)
