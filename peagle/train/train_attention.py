"""The drafters' training attention in bfloat16: AMX / oneDNN / MKL products around a C++ softmax (AVX-512 CPUs).

Invariant: ``block_attention(q, kv, blocks)`` gives each block's queries softmax(q k^T * scale, hidden keys -inf) v
over the key slices the block names, with its gradients -- what ``F.scaled_dot_product_attention`` computes block
by block over the gathered keys -- and the tests hold every path to a float64 reference. Where it runs (bfloat16
q/k/v, the C++ extension with AVX-512): the scores q k^T and dP = dO v^T in float32 (as a flash kernel accumulates
them), the softmax and its backward in one pass each (peagle/csrc/train_attn_avx512.cpp, denormals flushed) with P and
dS in bfloat16 (what the value, query and key products read; the backward reads that P). Where the CPU has
AMX-BF16 the scores are tiles of peagle/csrc/train_scores_amx.cpp, 32 rows at a time, softmaxed while in cache (no
float32 [rows, keys] tensor), and those rows of P (dS) times the values (keys) on the same tiles; else torch's
float32 products and oneDNN's. The backward is four products and a pass, where torch's CPU flash backward
recomputes the scores block by block. All blocks of a stream are one autograd node: a key slice that several
blocks read gets its gradients summed in place (float32) instead of one zero-filled full-size tensor per slice
and block. Elsewhere (float32, no AVX-512, no extension): torch's SDPA per block."""
from __future__ import annotations

import torch
import torch.nn.functional as F

USE_KERNEL = True   # False: torch's SDPA everywhere (A/B runs, tests)
AMX_SCORES = True   # False: torch's float32 score products around the softmax passes (A/B runs, tests)
CAUSAL_CHUNK = 128  # queries per block of a causal document
BF16 = torch.bfloat16


def _kernel(q: torch.Tensor):
    """The extension when it runs this attention, else None."""
    if q.dtype != BF16 or q.device.type != "cpu" or not USE_KERNEL:
        return None
    from ..models import quant_ext
    return quant_ext.avx512()


def _amx(ext, hd: int) -> bool:
    """The extension's AMX path (scores, softmax and P V / dS K per strip of rows; the CPU has AMX-BF16), else
    torch's float32 products around the softmax passes."""
    return AMX_SCORES and ext.has_amx_bf16() and hd % 32 == 0


def _probs(ext, qg, ks, vs, mask, scale) -> tuple:
    """(p, p v): p = softmax(qg k^T * scale under mask) in bfloat16 [B,nkv,M,S], p v [B,nkv,M,hd]; qg
    [B,nkv,M,hd], the keys / values as parts ks / vs [B,nkv,S_i,hd] (concatenated: S keys)."""
    if _amx(ext, qg.shape[-1]):
        return ext.attn_probs(qg, ks, vs, mask, scale)
    k, v = _cat(ks), _cat(vs)
    s = torch.matmul(qg.float(), k.float().transpose(-1, -2).contiguous())      # [B,nkv,M,S] float32
    p16 = ext.attn_softmax_forward(s.view(-1, s.shape[-1]), mask, scale).view(s.shape)
    return p16, torch.matmul(p16, v)


def _dscores(ext, dog, vs, p16, ks, scale) -> tuple:
    """(dS, dS k): d loss / d raw scores in bfloat16 [B,nkv,M,S] from dO [B,nkv,M,hd], the values (parts, as
    _probs takes them) and _probs' p16, and its product with the keys [B,nkv,M,hd]."""
    if _amx(ext, dog.shape[-1]):
        return ext.attn_dscores(dog, vs, p16, ks, scale)
    k, v = _cat(ks), _cat(vs)
    dp = torch.matmul(dog.float(), v.float().transpose(-1, -2).contiguous())    # [B,nkv,M,S] float32
    S = dp.shape[-1]
    ds = ext.attn_softmax_backward(dp.view(-1, S), p16.view(-1, S), scale).view(dp.shape)
    return ds, torch.matmul(ds, k)


def _parts(srcs, parts) -> list:
    """The key (or value) rows parts = [(source, start, end)] of srcs [B,nkv,S_i,hd], as views."""
    return [srcs[i][:, :, s:e] for i, s, e in parts]


def _cat(views) -> torch.Tensor:
    return views[0] if len(views) == 1 else torch.cat(views, 2)


def _gather(srcs, parts) -> torch.Tensor:
    """_parts concatenated along S."""
    return _cat(_parts(srcs, parts))


class _Blocks(torch.autograd.Function):
    """q [B,T,nh,hd] bfloat16, blocks (see block_attention), ext, then kv = (k0, v0, k1, v1, ..) [B,nkv,S_i,hd]
    bfloat16 (nh a multiple of nkv: head h reads kv head h // (nh/nkv)) -> [B,T,nh,hd]."""

    @staticmethod
    def forward(ctx, q, blocks, ext, *kv):
        B, T, nh, hd = q.shape
        nkv = kv[0].shape[1]
        scale, out, saved = hd ** -0.5, q.new_zeros(B, T, nh, hd), []
        with torch.autocast("cpu", enabled=False):
            for a, b, parts, mask in blocks:
                ks, vs = _parts(kv[0::2], parts), _parts(kv[1::2], parts)
                qg = q[:, a:b].transpose(1, 2).reshape(B, nkv, -1, hd)              # [B,nkv,g*n,hd], row = (head, t)
                p16, o = _probs(ext, qg, ks, vs, mask, scale)                          # [B,nkv,g*n,S], [..,hd]
                out[:, a:b] = o.view(B, nh, b - a, hd).transpose(1, 2)
                saved.append((qg, p16))
        ctx.save_for_backward(*kv)
        ctx.blocks, ctx.saved, ctx.ext, ctx.scale = blocks, saved, ext, scale
        return out

    @staticmethod
    def backward(ctx, do):
        kv = ctx.saved_tensors
        B, T, nh, hd = do.shape
        nkv = kv[0].shape[1]
        dq = do.new_zeros(B, T, nh, hd, dtype=BF16)
        acc = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if need else None
               for t, need in zip(kv, ctx.needs_input_grad[3:])]                    # key/value gradients, summed
        with torch.autocast("cpu", enabled=False):
            for (a, b, parts, _), (qg, p16) in zip(ctx.blocks, ctx.saved):
                ks, vs = _parts(kv[0::2], parts), _parts(kv[1::2], parts)
                dog = do[:, a:b].transpose(1, 2).reshape(B, nkv, -1, hd).to(BF16)   # [B,nkv,g*n,hd]
                ds, dqg = _dscores(ctx.ext, dog, vs, p16, ks, ctx.scale)               # [B,nkv,g*n,S], [..,hd]
                dq[:, a:b] = dqg.view(B, nh, b - a, hd).transpose(1, 2)
                dk = torch.matmul(ds.transpose(-1, -2), qg)                          # [B,nkv,S,hd]
                dv = torch.matmul(p16.transpose(-1, -2), dog)                        # [B,nkv,S,hd]
                off = 0
                for i, s, e in parts:
                    for j, d in ((2 * i, dk), (2 * i + 1, dv)):
                        if acc[j] is not None:
                            acc[j][:, :, s:e] += d[:, :, off:off + e - s]
                    off += e - s
        return (dq, None, None) + tuple(None if t is None else t.to(BF16) for t in acc)


def block_attention(q, kv, blocks):
    """q [B,T,nh,hd]; kv = (k0, v0, k1, v1, ..): key/value sources [B,nkv,S_i,hd] (GQA when nkv < nh);
    blocks = [(a, b, parts, mask)] in query order, covering 0..T-1: queries a..b-1 attend over the source rows
    parts = [(source, start, end)] concatenated, under mask [b-a, keys] bool (True = visible) -> [B,T,nh,hd]."""
    ext = _kernel(q)
    if ext is not None and all(t.dtype == q.dtype for t in kv):
        return _Blocks.apply(q, [(a, b, p, m.contiguous()) for a, b, p, m in blocks if b > a], ext, *kv)
    qt, gqa = q.transpose(1, 2), kv[0].shape[1] != q.shape[2]
    o = torch.cat([F.scaled_dot_product_attention(qt[:, :, a:b], _gather(kv[0::2], parts), _gather(kv[1::2], parts),
                                                  attn_mask=mask[None, None], enable_gqa=gqa)
                   for a, b, parts, mask in blocks], 2)
    return o.transpose(1, 2)


def causal_blocks(spans, device, chunk: int = CAUSAL_CHUNK) -> list:
    """block_attention's blocks for whole documents (start, end) of one stream attended causally: queries in
    chunks of ``chunk``, each over its document's keys up to its last query (about half the masked square)."""
    return [(a, min(a + chunk, e), [(0, s, min(a + chunk, e))],
             torch.ones(min(a + chunk, e) - a, min(a + chunk, e) - s, dtype=torch.bool, device=device).tril_(a - s))
            for s, e in spans for a in range(s, e, chunk)]


def causal_attention(q, k, v, spans, chunk: int = CAUSAL_CHUNK):
    """Whole documents (spans) of one stream, each attended causally: q [B,T,nh,hd], k/v [B,nkv,T,hd] ->
    [B,T,nh,hd]. Without the kernel: torch's causal SDPA (its flash kernel) per document."""
    if _kernel(q) is not None:
        return block_attention(q, (k, v), causal_blocks(spans, q.device, chunk))
    qt, gqa = q.transpose(1, 2), k.shape[1] != q.shape[2]
    return torch.cat([F.scaled_dot_product_attention(qt[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                     enable_gqa=gqa) for s, e in spans], 2).transpose(1, 2)
