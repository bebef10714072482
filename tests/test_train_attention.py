"""peagle/train/train_attention.py: the bfloat16 training attention (C++ softmax between float32 / bfloat16
products) against a float64 reference, with negative controls; its fallback is torch's SDPA."""
import pytest
import torch
import torch.nn.functional as F

from peagle.models import quant_ext
from peagle.train import train_attention as ta

ext = quant_ext.get()
HAS_KERNEL = quant_ext.avx512() is not None
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="the kernel needs the extension on an AVX-512 CPU")


def _qkv(B, nh, nkv, T, S, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, 64, generator=g).bfloat16() for h, n in ((nh, T), (nkv, S), (nkv, S)))
    return q, k, v, torch.randn(B, nh, T, 64, generator=g).bfloat16()


def _ref64(q, k, v, mask, do):
    """float64 SDPA of the same bfloat16 values: (o, dq, dk, dv)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=k.shape[1] != q.shape[1])
    o.backward(do.double())
    return [o.detach(), q.grad, k.grad, v.grad]


def _run(fn, q, k, v, do):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    assert q.grad.dtype == torch.bfloat16 and k.grad.shape == k.shape
    return [o.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


def _worst(got, ref):
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


@needs_kernel
def test_softmax_kernels_are_the_masked_softmax_and_its_gradient():
    """The two passes alone on float32 rows: S not a multiple of 16 (masked tails), 3 heads over a [T, S] mask,
    a row with no visible key gives zeros; the bfloat16 probabilities within one rounding of float64's, the
    gradient from them within bfloat16 rounding. Negative control: the mask of the next query gives other
    probabilities."""
    g = torch.Generator().manual_seed(0)
    for T, S in ((5, 1), (7, 15), (4, 17), (6, 501)):
        s, dp = torch.randn(3 * T, S, generator=g) * 4, torch.randn(3 * T, S, generator=g)
        mask = torch.rand(T, S, generator=g) < 0.6
        mask[:, 0] = True
        mask[T - 1] = False
        p = ext.attn_softmax_forward(s, mask, 0.3)
        m = mask.repeat(3, 1)
        want = torch.softmax((s.double() * 0.3).masked_fill(~m, float("-inf")), -1).nan_to_num(0.0)
        assert p.dtype == torch.bfloat16 and torch.allclose(p.double(), want, rtol=2 ** -8, atol=1e-7)
        assert float(p.view(3, T, S)[:, T - 1].abs().max()) == 0.0
        ds = ext.attn_softmax_backward(dp, p, 0.3)
        d = p.double() * (dp.double() - (p.double() * dp.double()).sum(-1, keepdim=True)) * 0.3
        assert ds.dtype == torch.bfloat16 and torch.allclose(ds.double(), d, rtol=1e-2, atol=1e-6)
        if T > 1 and S > 1:
            p_other = ext.attn_softmax_forward(s, mask.roll(1, 0).contiguous(), 0.3)
            assert not torch.allclose(p_other.float(), p.float(), atol=1e-3)
    with pytest.raises(RuntimeError, match="mask"):
        ext.attn_softmax_forward(torch.zeros(5, 8), torch.ones(2, 8, dtype=torch.bool), 1.0)


def test_softmax_tails_below_the_smallest_normal_are_zero():
    """Denormals are flushed in the softmax passes (the CPU's slow path otherwise): a row whose smallest
    probability is e^-87 / 2 (below float32's smallest normal, 1.18e-38) gives 0 there, and the rest of the row
    as before. It fails where the passes compute in denormals."""
    if not HAS_KERNEL:
        pytest.skip("the kernel needs the extension on an AVX-512 CPU")
    s = torch.tensor([[0.0, 0.0] + [-200.0] * 18])
    p = ext.attn_softmax_forward(s, torch.ones(1, 20, dtype=torch.bool), 1.0)
    assert float(p[0, 2:].float().abs().max()) == 0.0 and torch.equal(p[0, :2].float(), torch.tensor([0.5, 0.5]))
    ds = ext.attn_softmax_backward(torch.full((1, 20), 1e-3), p, 1.0)
    tiny = ds.float().abs()
    assert not bool(((tiny > 0) & (tiny < torch.finfo(torch.float32).tiny)).any())


@pytest.mark.skipif(not (HAS_KERNEL and ext.has_amx_bf16()), reason="the AMX score products need AMX-BF16")
def test_amx_probs_and_dscores_are_the_softmax_of_float32_scores():
    """attn_probs / attn_dscores (scores on AMX tiles, softmax in cache, then P V and dS K on the tiles) against
    float64 of the same bfloat16 values: rows and keys not multiples of the tiles' 16 / 32, a strided slice of the
    keys, keys and values in parts, head dims 32 / 64 / 96, a mask shared by 3 heads per kv head; P within one
    bfloat16 rounding, dS within bfloat16 rounding of the reference from that P, P V and dS K float32 sums of
    those bfloat16 values. Negative controls: keys and values shifted by one; head dims not a multiple of 32
    raise."""
    g = torch.Generator().manual_seed(3)
    for B, H, T, N, D in ((1, 3, 70, 501, 64), (2, 2, 13, 37, 32), (1, 1, 1, 1, 32), (1, 2, 40, 70, 96)):
        q = torch.randn(B, H, 3 * T, D, generator=g).bfloat16()
        k = torch.randn(B, H, N + 5, D, generator=g).bfloat16()[:, :, 3:3 + N]
        do, v = torch.randn(B, H, 3 * T, D, generator=g).bfloat16(), torch.randn(B, H, N, D, generator=g).bfloat16()
        mask = torch.rand(T, N, generator=g) < 0.6
        mask[:, 0] = True
        s = (q.double() @ k.double().transpose(-1, -2) * 0.125).masked_fill(~mask.repeat(3, 1), float("-inf"))
        p, o = ext.attn_probs(q, [k[:, :, :N // 2], k[:, :, N // 2:]], [v], mask, 0.125)
        assert p.dtype == torch.bfloat16 and torch.allclose(p.double(), s.softmax(-1), rtol=2 ** -8, atol=1e-7)
        pv = p.double() @ v.double()                           # the products: float32 sums of bfloat16 p, v
        assert o.dtype == torch.float32 and float((o.double() - pv).abs().max()) < 1e-5 * N
        dp = do.double() @ v.double().transpose(-1, -2)
        want = p.double() * (dp - (p.double() * dp).sum(-1, keepdim=True)) * 0.125
        ds, dq = ext.attn_dscores(do, [v[:, :, :1], v[:, :, 1:]], p, [k], 0.125)
        assert ds.dtype == torch.bfloat16 and float((ds.double() - want).abs().max()) <= 2e-2 * float(want.abs().max())
        assert float((dq.double() - ds.double() @ k.double()).abs().max()) < 1e-5 * N
        if N > 1:
            off, o_off = ext.attn_probs(q, [k.roll(1, 2)], [v.roll(1, 2)], mask, 0.125)
            assert float((off.double() - s.softmax(-1)).abs().max()) > 0.05
            assert float((o_off.double() - pv).abs().max()) > 0.05
    with pytest.raises(RuntimeError, match="multiple of 32"):
        z = torch.zeros(1, 1, 4, 16).bfloat16()
        ext.attn_probs(z, [z], [z], torch.ones(4, 4, dtype=torch.bool), 1.0)


def _one_block(mask):
    """block_attention over one source and one block, in masked SDPA's [B,nh,T,hd] layout."""
    T, S = mask.shape
    return lambda q, k, v: ta.block_attention(q.transpose(1, 2), (k, v), [(0, T, [(0, 0, S)], mask)]).transpose(1, 2)


@pytest.mark.parametrize("kernel,amx", [(True, True), (True, False), (False, False)])
def test_block_attention_matches_float64(kernel, amx, monkeypatch):
    """One block: output and gradients of q, k, v (GQA 6 heads over 2, batch of 2, S = 70 not a multiple of 16)
    within bfloat16 rounding of the float64 reference, through the kernel or torch's SDPA (the fallback); the
    kernel path really runs. Negative control: the reference of a mask with one more hidden key per query differs."""
    if kernel and not HAS_KERNEL:
        pytest.skip("the kernel needs the extension on an AVX-512 CPU")
    monkeypatch.setattr(ta, "USE_KERNEL", kernel)
    monkeypatch.setattr(ta, "AMX_SCORES", amx)
    q, k, v, do = _qkv(2, 6, 2, 37, 70, seed=1)
    mask = torch.rand(37, 70, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[:, 3] = True
    assert (ta._kernel(q) is not None) == kernel
    got = _run(_one_block(mask), q, k, v, do)
    ref = _ref64(q, k, v, mask, do)
    assert _worst(got, ref) < 2e-2, _worst(got, ref)
    fewer = mask.clone()
    fewer[:, 3] = False
    assert _worst(got, _ref64(q, k, v, fewer, do)) > 5e-2


@pytest.mark.parametrize("kernel,amx", [(True, True), (True, False), (False, False)])
def test_blocks_over_shared_key_slices_match_float64(kernel, amx, monkeypatch):
    """Three blocks of queries over overlapping slices of a second source (a past) and their own keys -- the
    gradients of a past key several blocks read are summed -- equal one masked float64 attention over [past |
    own] keys whose mask is the blocks' masks placed at their slices. Negative control: a block that drops its
    past slice's last key gives other values."""
    if kernel and not HAS_KERNEL:
        pytest.skip("the kernel needs the extension on an AVX-512 CPU")
    monkeypatch.setattr(ta, "USE_KERNEL", kernel)
    monkeypatch.setattr(ta, "AMX_SCORES", amx)
    g = torch.Generator().manual_seed(5)
    T, P = 40, 50
    q, k, v, do = _qkv(1, 6, 2, T, T + P, seed=3)
    spec = [(0, 9, 0, 20), (9, 25, 5, 41), (25, 40, 30, 50)]            # (a, b, past start, past end)
    full = torch.zeros(T, T + P, dtype=torch.bool)
    blocks = []
    for a, b, s, e in spec:
        m = torch.rand(b - a, e - s + b - a, generator=g) < 0.6
        m[:, 0] = True
        full[a:b, s:e], full[a:b, P + a:P + b] = m[:, :e - s], m[:, e - s:]
        blocks.append((a, b, [(1, s, e), (0, a, b)], m))

    def fn(blocks):
        return lambda q, k, v: ta.block_attention(q.transpose(1, 2), (k[:, :, P:], v[:, :, P:], k[:, :, :P], v[:, :, :P]),
                                                  blocks).transpose(1, 2)
    got = _run(fn(blocks), q, k, v, do)
    ref = _ref64(q, k, v, full, do)
    assert _worst(got, ref) < 2e-2, _worst(got, ref)
    short = [(a, b, [(1, s, e - 1), (0, a, b)], torch.cat([m[:, :e - s - 1], m[:, e - s:]], 1))
             for (a, b, _, m), (_, _, s, e) in zip(blocks, spec)]
    assert _worst(_run(fn(short), q, k, v, do), ref) > 5e-2


@needs_kernel
@pytest.mark.parametrize("n,chunk", [(300, 128), (40, 16), (9, 128)])
def test_causal_attention_in_chunks_matches_float64(n, chunk):
    """Two causal documents of one stream in query chunks over each document's keys up to the chunk's end = the
    block-diagonal causal float64 reference (and torch's causal flash kernel per document, within rounding).
    Negative control: chunks that see one key too few."""
    q, k, v, do = _qkv(1, 9, 3, n, n, seed=n)
    spans = [(0, n // 3), (n // 3, n)]
    causal = torch.zeros(n, n, dtype=torch.bool)
    for s, e in spans:
        causal[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    ref = _ref64(q, k, v, causal, do)

    def doc_causal(chunk, kernel=True):
        def fn(q, k, v):
            ta.USE_KERNEL = kernel
            try:
                return ta.causal_attention(q.transpose(1, 2), k, v, spans, chunk).transpose(1, 2)
            finally:
                ta.USE_KERNEL = True
        return fn
    got = _run(doc_causal(chunk), q, k, v, do)
    flash = _run(doc_causal(chunk, kernel=False), q, k, v, do)
    assert _worst(got, ref) < 2e-2 and _worst(flash, ref) < 2e-2
    shifted = causal.clone()
    shifted[1:, :] &= torch.ones(n, n, dtype=torch.bool).tril(-1)[1:, :]
    assert _worst(got, _ref64(q, k, v, shifted, do)) > 5e-2
