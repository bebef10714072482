"""Weight-only quantized linears (peagle/models/quant.py, csrc/): the kernels against a dequantized float
reference, batch invariance (a row's result bit-identical whatever the other rows), GGUF blocks loaded as
stored against transformers' / gguf's dequantized reading, and greedy speculative output identical to plain
decoding on q8 and q4 targets. Every kernel test runs on the torch fallback and, where the C++ extension is
built (`make setup`), on its scalar and AVX2 paths."""
import os

import numpy as np
import pytest
import torch

from peagle.models import quant as Q
from peagle.models import quant_ext

EXT = quant_ext.get()
IMPLS = [-1] + ([1] + ([2] if EXT.has_avx2() else []) + ([3] if EXT.has_avx512() else [])
                + ([4] if EXT.has_amx() else []) if EXT is not None else [])
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
KTYPES = TYPES + [Q.F32]      # F32: a float32 target's rows through the same kernels (no 8-bit activations)
KTYPES_ACT8 = [(q, a) for q in KTYPES for a in (False, True) if not (a and q == Q.F32)]


def random_blocks(qtype, n, k, seed=0, act8=False):
    """Random valid blocks (scales of either sign, every code) of a [n, k] weight (act8: its products quantize
    the activations to 8 bits)."""
    g = torch.Generator().manual_seed(seed)
    if qtype == Q.F32:
        return Q.QuantWeight.from_float(torch.randn(n, k, generator=g) * 0.1, Q.F32)
    nb = k // 32
    d = ((torch.rand(n, nb, 1, generator=g) - 0.5) * 0.2).half().view(torch.uint8).reshape(n, nb, 2)
    if qtype == Q.Q4_0:
        body = [d, torch.randint(0, 256, (n, nb, 16), generator=g, dtype=torch.uint8)]
    elif qtype == Q.Q4_1:
        m = ((torch.rand(n, nb, 1, generator=g) - 0.5) * 0.5).half().view(torch.uint8).reshape(n, nb, 2)
        body = [d, m, torch.randint(0, 256, (n, nb, 16), generator=g, dtype=torch.uint8)]
    else:
        body = [d, torch.randint(0, 256, (n, nb, 32), generator=g, dtype=torch.uint8)]
    return Q.QuantWeight(torch.cat(body, -1).reshape(n, -1), qtype, n, k, act8=act8)


def test_extension_status_is_reported():
    assert quant_ext.describe().startswith("C++ kernels") == (EXT is not None)
    if os.environ.get("PEAGLE_REQUIRE_EXT") == "1":       # CI on a built checkout: the fallback must not hide a failure
        assert EXT is not None, quant_ext.why_not()


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


@pytest.mark.skipif(EXT is None or not _cpu_flags(), reason="needs the built extension and /proc/cpuinfo")
def test_vector_paths_follow_the_cpu_flags():
    """The run-time dispatch sees what the kernel reports: AVX2 (+FMA, F16C) and AVX-512 (F, VL, BW, DQ, VNNI)."""
    flags = _cpu_flags()
    assert EXT.has_avx2() == ({"avx2", "fma", "f16c"} <= flags)
    assert EXT.has_avx512() == ({"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512dq",
                                  "avx512_vnni"} <= flags)
    assert ("AVX-512" in quant_ext.describe()) == EXT.has_avx512()
    # AMX: the flags are necessary, not sufficient (the OS must grant the tile state and a probe product pass)
    assert not EXT.has_amx() or ({"amx_tile", "amx_int8"} <= flags and EXT.has_avx512())
    assert ("AMX" in quant_ext.describe()) == EXT.has_amx()


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
def test_amx_can_be_switched_off():
    """PEAGLE_AMX=0 keeps the tile unit off (the AVX-512 path runs the same bits); without it the path is
    what the probe found (this process's answer)."""
    import subprocess
    import sys
    code = "from peagle.models import quant_ext as q; m = q.get(); print(m.has_amx(), 'AMX' in q.describe())"
    out = {v: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PEAGLE_AMX": v}).stdout.split() for v in ("0", "1")}
    assert out["0"] == ["False", "False"]
    assert out["1"] == [str(EXT.has_amx()), str(EXT.has_amx())]


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_exact_and_matches_gguf(qtype):
    import gguf
    w = random_blocks(qtype, 24, 96)
    ref = Q.dequantize_torch(w.data, qtype, w.n, w.k)
    if EXT is not None:
        assert torch.equal(EXT.dequantize(w.data, qtype, w.n, w.k), ref)
    g = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(qtype)).astype(np.float32))
    if qtype == Q.Q4_1:        # gguf computes d*q + m with two roundings, peagle (and llama.cpp's fma) with one
        assert torch.allclose(g, ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    else:
        assert torch.equal(g, ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype", KTYPES)
def test_kernel_matches_dequantized_reference(qtype, impl):
    w = random_blocks(qtype, 70, 160, seed=qtype)
    W = Q.dequantize_torch(w.data, qtype, w.n, w.k).double()
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 5, 16, 33):
        x = torch.randn(m, w.k, generator=g)
        y = Q.qmm(x, w, impl)
        ref = x.double() @ W.t()
        assert y.shape == (m, w.n) and y.dtype == torch.float32
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), (m, impl)
    x3 = torch.randn(2, 3, w.k, generator=g)                         # leading dims kept
    assert torch.equal(Q.qmm(x3, w, impl), Q.qmm(x3.reshape(6, -1), w, impl).view(2, 3, -1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype,act8", KTYPES_ACT8)
def test_batch_invariance_bit_identical(qtype, impl, act8):
    """A row's output is the same bits at M = 1..5, 8, 9, 16 (the kernel's one-row, few-row and scratch paths)
    and in any position of the batch; with float32 and with 8-bit activations."""
    w = random_blocks(qtype, 37, 192, seed=5, act8=act8)
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(16, w.k, generator=g)
    alone = torch.cat([Q.qmm(rows[i:i + 1], w, impl) for i in range(16)])
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        for start in range(0, 16 - m + 1, max(1, (16 - m) // 3 or 1)):
            got = Q.qmm(rows[start:start + m], w, impl)
            assert torch.equal(got, alone[start:start + m]), (m, start)
    perm = torch.randperm(16, generator=g)
    assert torch.equal(Q.qmm(rows[perm], w, impl), alone[perm])
    # larger calls still run the same per-row arithmetic up to KERNEL_MAX_ROWS; a8 and F32 products at any count
    n = 9 if (act8 or qtype == Q.F32) and impl >= 0 else 5          # 144 rows: past KERNEL_MAX_ROWS
    many = torch.cat([rows] * n)
    assert torch.equal(Q.qmm(many, w, impl), torch.cat([alone] * n))


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("qtype,act8", KTYPES_ACT8)
def test_vector_paths_agree_with_scalar_bit_for_bit(qtype, act8):
    """The AVX2 path, and the AVX-512 and AMX ones where the CPU has them, give the scalar path's bits (45
    outputs: 6 groups of 8, the last one partial; 37: an odd 5th group; AMX: row tiles of 8, a last one of up to
    3 rows after full ones on the AVX-512 path (17-19, 33, 130), a longer one padded (20, 22); AVX-512 alone: a
    last tile of 9 rows as one (9, 17, 33))."""
    for n in (45, 37):
        w = random_blocks(qtype, n, 224, seed=9, act8=act8)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14, 16, 17, 19, 20, 22, 32, 33, 130):
            x = torch.randn(m, w.k)
            ref = Q.qmm(x, w, 1)
            for impl in IMPLS[2:] + [0]:       # 0: the best path per row count (AMX from 16 rows where it runs)
                assert torch.equal(ref, Q.qmm(x, w, impl)), (n, m, impl)


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("qtype,act8", KTYPES_ACT8)
def test_threads_split_the_outputs_without_changing_a_bit(qtype, act8):
    """With 2 threads the products split their outputs into tasks (K = 4096: a task per group or two), odd
    ranges and odd group counts in the middle of N included; every path gives the 1-thread scalar bits."""
    w = random_blocks(qtype, 77, 4096, seed=11, act8=act8)
    xs = [torch.randn(m, w.k) for m in (1, 5)]
    refs = [Q.qmm(x, w, 1) for x in xs]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for x, ref in zip(xs, refs):
            for impl in IMPLS[1:]:
                assert torch.equal(ref, Q.qmm(x, w, impl)), (x.shape[0], impl)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
def test_unknown_kernel_path_is_refused():
    w = random_blocks(Q.Q8_0, 8, 64, seed=1)
    with pytest.raises(RuntimeError, match="unknown kernel path"):
        EXT.qlinear(torch.randn(1, 64), w.data, w.qtype, w.n, w.k, 5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype", TYPES)
def test_8bit_activations_match_their_reference(qtype, impl):
    """q8a8 / q4a8 products: x quantized per block of 32 (amax / 127, round half to even) times the dequantized
    weight, in float64, to float32 rounding; the extension's quantize_act equals the torch one. Negative
    control: the same product with float32 activations differs by far more (the activations are quantized)."""
    w = random_blocks(qtype, 70, 160, seed=qtype, act8=True)
    W = Q.dequantize_torch(w.data, qtype, w.n, w.k).double()
    g = torch.Generator().manual_seed(3)
    for m in (1, 2, 3, 5, 16, 33):
        x = torch.randn(m, w.k, generator=g)
        x[0, :32] = 0.0                                                       # an all-zero block: scale 0
        if m > 1:                                                             # ties: x / xd = k + 1/2 exactly
            x[1, 32:64] = torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])
        xq, xd = Q.quantize_act_torch(x)
        for ext_impl in IMPLS[1:]:                                            # the scalar and AVX2 paths
            q2, d2, s2 = EXT.quantize_act(x, ext_impl)
            assert torch.equal(q2, xq) and torch.equal(d2, xd), ext_impl
            assert torch.equal(s2, xd * xq.reshape(m, -1, 32).sum(-1).float())
        xa = (xq.double().reshape(m, -1, 32) * xd.double()[..., None]).reshape(m, -1)
        ref = xa @ W.t()
        y = Q.qmm(x, w, impl)
        tol = 1e-5 * float(ref.abs().max())
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=tol), (m, impl)
        off = float((x.double() @ W.t() - ref).abs().max())
        assert off > 100 * tol, (m, off, tol)


def test_f32_packs_the_weight_by_8_and_refuses_8bit_activations():
    W = torch.randn(43, 64)                         # 43 outputs: the last group of 8 padded with zero rows
    w = Q.QuantWeight.from_float(W, Q.F32)
    assert tuple(w.data.shape) == (48, 256) and torch.equal(w.dense(), W)
    f = w.data.view(torch.float32).reshape(-1)
    assert torch.equal(f[64 * 3 + 8 * 2: 64 * 3 + 8 * 3], W[2, 24:32])           # group 0, chunk 3, output 2
    assert torch.equal(f[8 * 64 + 8 * 1: 8 * 64 + 8 * 2], W[9, 0:8])             # group 1, chunk 0, output 1
    assert f[5 * 8 * 64:].view(8, 8, 8)[:, 3:].abs().sum() == 0                  # padding rows 43..47
    with pytest.raises(ValueError, match="8-bit"):
        Q.QuantWeight.from_float(W, Q.F32, act8=True)
    if EXT is not None:
        with pytest.raises(RuntimeError, match="unsupported qtype"):
            EXT.pack_a8(w.data, Q.F32, w.n, w.k)


def test_many_rows_take_dequantize_then_gemm():
    w = random_blocks(Q.Q4_1, 20, 64)
    x = torch.randn(Q.KERNEL_MAX_ROWS + 3, w.k)
    ref = x.double() @ Q.dequantize_torch(w.data, w.qtype, w.n, w.k).double().t()
    assert torch.allclose(Q.qmm(x, w).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_quantizers_match_gguf_and_bound_the_error(qtype):
    import gguf
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 128, generator=g) * 0.05
    q = Q.QuantWeight.from_float(w, qtype)
    ours = q.dense()
    theirs = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(qtype)),
                                    gguf.GGMLQuantizationType(qtype))
    step = (w.view(48, 4, 32).amax(-1) - w.view(48, 4, 32).amin(-1)) / (15 if qtype == Q.Q4_1 else 254)
    err = (ours - w).abs().view(48, 4, 32).amax(-1)
    assert (err <= 0.51 * step + 1e-3 * w.abs().max()).all()
    # the same codes as gguf's reference quantizer, up to a rare rounding tie
    assert (torch.from_numpy(theirs) - ours).abs().gt(1e-6).float().mean() < 0.01


def test_q4_0_rewritten_as_q4_1_is_the_same_weight():
    w = random_blocks(Q.Q4_0, 12, 64)
    w1 = Q.q4_0_as_q4_1(w)
    assert w1.qtype == Q.Q4_1 and torch.equal(w1.dense(), w.dense())
    cat = Q.quant_cat([w, random_blocks(Q.Q4_1, 4, 64)])
    assert isinstance(cat, Q.QuantWeight) and cat.qtype == Q.Q4_1 and cat.n == 16
    stack = Q.quant_cat([w, random_blocks(Q.Q8_0, 4, 64)])
    assert isinstance(stack, Q.QuantStack)
    x = torch.randn(3, 64)
    assert torch.allclose(Q.qmm(x, stack), x @ stack.dense().t(), atol=1e-5)


def test_fused_ops_match_torch():
    g = torch.Generator().manual_seed(4)
    x, h, wt = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.rand(64, generator=g) + 0.5
    s, n = Q.add_rms_norm(x, h, wt, 1e-5)
    assert torch.equal(s, x + h)
    assert torch.allclose(n, torch.nn.functional.rms_norm(x + h, (64,), wt, 1e-5), atol=1e-5)
    gu = torch.randn(3, 2, 80, generator=g)
    assert torch.allclose(Q.silu_mul(gu), torch.nn.functional.silu(gu[..., :40]) * gu[..., 40:], atol=1e-6)
    # every range the own exp meets (e^-a past float's range both ways), a tail of 5, and batch invariance
    a = torch.cat([torch.linspace(-120, 120, 37), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5])])
    gu = torch.cat([a, torch.randn(a.numel(), generator=g)]).reshape(1, -1)
    ref = torch.nn.functional.silu(gu[:, :43].double()) * gu[:, 43:].double()
    got = Q.silu_mul(gu)
    assert torch.allclose(got.double(), ref, rtol=2e-6, atol=1e-30), (got.double() - ref).abs().max()
    assert torch.equal(Q.silu_mul(gu.repeat(3, 1))[1:2], got)


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
@pytest.mark.parametrize("one_slice", [True, False])
def test_fused_rope_and_cache_write_match_the_torch_ops_bit_for_bit(one_slice):
    """quant.rope_kv == apply_rope + KVCache.write (q returned, k rotated and v in the cache), for a block that
    starts at one position in every row and for ragged rows; negative control: a wrong sin changes the bits."""
    from peagle.cache import KVCache
    from peagle.models.layers import BlockCtx, Rope, apply_rope
    g = torch.Generator().manual_seed(6)
    nh, nkv, hd, B, T = 6, 2, 16, 3, 4
    start = torch.tensor([5, 5, 5]) if one_slice else torch.tensor([5, 0, 9])
    rope = Rope(hd, 10000.0, None, 64)
    ctx = BlockCtx(rope, start, T, b0=1)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hd, generator=g)
    ref, fused = (KVCache(2, nkv, hd, 32, rows=B + 1, initial_len=16) for _ in range(2))
    qk = apply_rope(qkv[..., : (nh + nkv) * hd].view(B, T, nh + nkv, hd), ctx.cos, ctx.sin)
    ref.reserve(ctx.S)
    ref.write(1, 1, ctx.pos_w, qk[:, :, nh:], qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd))
    fused.reserve(ctx.S)
    q = Q.rope_kv(qkv, ctx.cos, ctx.sin, fused, 1, 1, ctx.pos_w, nh, nkv)
    assert torch.equal(q, qk[:, :, :nh]) and torch.equal(fused.k[1], ref.k[1]) and torch.equal(fused.v[1], ref.v[1])
    assert fused.k[0].abs().sum() == 0 and fused.k[1][0].abs().sum() == 0          # other layers, rows untouched
    bad = Q.rope_kv(qkv, ctx.cos, -ctx.sin, fused, 1, 1, ctx.pos_w, nh, nkv)
    assert not torch.equal(bad, qk[:, :, :nh]) and not torch.equal(fused.k[1], ref.k[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        Q.rope_kv(qkv, ctx.cos, ctx.sin, fused, 1, 1, ctx.pos_w + 100, nh, nkv)


# ---- targets -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qtarget(tmp_path_factory):
    """A tiny llama whose every projection width is a multiple of 32 (all quantized)."""
    from tiny import save_tiny
    return save_tiny("llama", str(tmp_path_factory.mktemp("q") / "llama"), intermediate_size=128)


def test_quantized_target_close_to_float(qtarget):
    from peagle.models.llama import Transformer
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for q in ("none", "q8", "q4", "q4a8"):
        t = Transformer.from_pretrained(qtarget, quantization=q)
        out[q], _ = t.forward(ids, t.new_cache(2, 16), 0, torch.zeros(2, dtype=torch.long))
        if q != "none":
            assert all(getattr(w, "quantized", False) for w in t._projections())
            assert q in t.precision
            assert all(getattr(p, "act8", False) == q.endswith("a8") for w in t._projections()
                       for p in getattr(w, "parts", None) or [w])
    rel = {q: float((out[q] - out["none"]).norm() / out["none"].norm()) for q in ("q8", "q4", "q4a8")}
    assert rel["q8"] < 0.03 and rel["q4"] < 0.4 and rel["q8"] < rel["q4"] / 4, rel   # random weights: 4 bits hurt
    a8 = float((out["q4a8"] - out["q4"]).norm() / out["q4"].norm())
    assert 1e-4 < a8 < 0.1, a8                      # 8-bit activations: a small, nonzero change to q4


def _spec(head, k, parallel):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": parallel}


@pytest.mark.parametrize("quantization", ["q8", "q4", "q4a8", "q8a8"])
def test_greedy_speculative_identical_to_plain(qtarget, tmp_path, quantization):
    from fakes import FakeProposer, install_proposer
    from heads import save_random_head

    from peagle import LLM, SamplingParams
    g = torch.Generator().manual_seed(8)
    ps = [{"prompt_token_ids": torch.randint(5, 500, (int(n),), generator=g).tolist()}
          for n in torch.randint(2, 30, (6,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = LLM(qtarget, quantization=quantization)
    assert quantization in base.engine.target.precision
    ref = [o.outputs[0].token_ids for o in base.generate(ps, sp)]
    head = save_random_head(qtarget, str(tmp_path / "p"), layers=1)
    llm = LLM(qtarget, quantization=quantization, speculative_config=_spec(head, 3, True), max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == ref
    lm = llm.engine.proposer.head._lm_head_t                # the head's projections follow the target: Q8_0
    assert isinstance(lm, Q.QuantWeight) and lm.qtype == Q.Q8_0 and lm.act8 == quantization.endswith("a8")

    class Oracle(FakeProposer):          # proposes the plain continuation: long accepted blocks, bonus tokens
        def propose(self, batch, k=None):
            k = k or self.k
            out = []
            for r in batch.requests:
                full = truth[tuple(r.prompt_token_ids)]
                n = len(r.output_ids)
                out.append((full[n:n + k] + [7] * k)[:k])
            return torch.tensor(out)
    truth = {tuple(p["prompt_token_ids"]): r for p, r in zip(ps, ref)}
    for k in (1, 4, 7):
        llm = install_proposer(LLM(qtarget, quantization=quantization), Oracle(k), k)
        assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == ref
        assert llm.get_metrics()["mean_acceptance_length"] > 1 + 0.5 * k


def test_unsupported_quantization_is_refused(qtarget, monkeypatch):
    from peagle.errors import PeagleError
    from peagle.models.loader import load_target
    with pytest.raises(PeagleError, match="quantization"):
        load_target(qtarget, quantization="q3")
    with pytest.raises(PeagleError, match="native"):
        load_target(qtarget, backend="transformers", quantization="q8")
    monkeypatch.setattr(quant_ext, "get", lambda: None)        # 8-bit activations are exact only in the kernels
    with pytest.raises(PeagleError, match="C\\+\\+ kernels"):
        load_target(qtarget, quantization="q4a8")


# ---- GGUF ----------------------------------------------------------------------------------------------------------

def _permute(w, n_head, n_kv=None):   # llama.cpp's convert_hf_to_gguf permutation of q/k rows
    if n_kv is not None and n_head != n_kv:
        n_head = n_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(src_dir: str, path: str, types: dict) -> None:
    """The tiny llama of src_dir as a llama.cpp-style GGUF: q/k rows permuted, projections quantized per
    `types` (HF suffix -> GGML type), norms F32."""
    import gguf
    from safetensors.torch import load_file

    from peagle.models.config import ModelConfig
    cfg = ModelConfig.from_dir(src_dir)
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    from peagle.models.gguf_target import _LAYER
    for i in range(cfg.num_hidden_layers):
        for g, h in _LAYER.items():
            names[f"model.layers.{i}.{h}.weight"] = f"blk.{i}.{g}.weight"
    for hf, t in sd.items():
        a = t.float().numpy()
        if ".q_proj." in hf:
            a = _permute(a, cfg.num_attention_heads)
        elif ".k_proj." in hf:
            a = _permute(a, cfg.num_attention_heads, cfg.num_key_value_heads)
        qt = next((v for k, v in types.items() if hf.endswith(k)), None) if a.ndim == 2 else None
        if qt is None:
            w.add_tensor(names[hf], np.ascontiguousarray(a))
        else:
            w.add_tensor(names[hf], gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(qtarget, tmp_path_factory):
    import gguf
    T = gguf.GGMLQuantizationType
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(qtarget, path, {"q_proj.weight": T.Q4_0, "k_proj.weight": T.Q4_0, "v_proj.weight": T.Q4_1,
                                    "o_proj.weight": T.Q8_0, "gate_proj.weight": T.Q4_1, "up_proj.weight": T.Q4_1,
                                    "down_proj.weight": T.Q4_0, "embed_tokens.weight": T.Q8_0,
                                    "lm_head.weight": T.Q8_0})
    return path


def test_gguf_blocks_load_as_stored_and_match_transformers(tiny_gguf, qtarget):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from peagle.models.gguf_target import read_gguf
    from peagle.models.llama import Transformer
    d, name = os.path.split(tiny_gguf)
    cfg = AutoConfig.from_pretrained(d, gguf_file=name)
    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(cfg)
    hf = load_gguf_checkpoint(tiny_gguf, return_tensors=True, model_to_load=skel)["tensors"]
    _, floats, quants = read_gguf(tiny_gguf)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"} <= set(quants)
    assert {q.qtype for q in quants.values()} == {Q.Q4_0, Q.Q4_1, Q.Q8_0}
    for k, q in quants.items():                 # the blocks, unpermuted, dequantize to transformers' reading
        ref = torch.as_tensor(np.asarray(hf[k])).float()
        assert torch.allclose(q.dense(), ref, rtol=0, atol=1e-6 * float(ref.abs().max())), k
    for k, f in floats.items():
        assert torch.equal(f, torch.as_tensor(np.asarray(hf[k])).float()), k
    t = Transformer.from_gguf(tiny_gguf, quantization="q4")
    assert "tiny.gguf" in t.precision and "Q4_0" in t.precision
    assert isinstance(t.layers[0].qkv_w, Q.QuantWeight) and t.layers[0].qkv_w.qtype == Q.Q4_1  # Q4_0 q/k + Q4_1 v
    # logits: the GGUF's blocks as stored vs transformers' dequantized model on the same ids
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    missing = model.load_state_dict({k: torch.as_tensor(np.asarray(v)).float() for k, v in hf.items()}, strict=False)
    assert not [k for k in missing.missing_keys if "rotary" not in k]
    ids = torch.randint(5, 500, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    got, _ = t.forward(ids, t.new_cache(1, 16), 0, torch.zeros(1, dtype=torch.long))
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4)
    f32 = Transformer.from_gguf(tiny_gguf, quantization="none")       # read as float32: no block kept as stored
    assert all(getattr(w, "qtype", Q.F32) == Q.F32 for w in f32._projections())


def test_packaged_gguf_table_agrees_with_the_default_target():
    from peagle import default_target
    from peagle.models.gguf_target import PACKAGED
    assert PACKAGED[default_target.GGUF_SHA256] == (default_target.PACKAGE.replace("-", "_"), default_target.GGUF_NAME)


def test_default_target_q4_runs_the_packaged_gguf_blocks():
    """SmolLM2's float32 target is the dequantized Q4_1 file; q4 loads that file's blocks, which dequantize to
    the float32 checkpoint's weights."""
    from peagle.llm import DEFAULT_MODEL
    from peagle.models.gguf_target import source_gguf
    from peagle.models.llama import Transformer, load_safetensors
    if not os.path.isfile(os.path.join(DEFAULT_MODEL, "model.safetensors")) or source_gguf(DEFAULT_MODEL) is None:
        pytest.skip("the default target is not set up (make setup)")
    t = Transformer.from_pretrained(DEFAULT_MODEL, quantization="q4", layout="io")
    assert "Q4_1" in t.precision and ".gguf" in t.precision
    sd = load_safetensors(DEFAULT_MODEL, torch.float32)
    for i in (0, len(t.layers) - 1):
        p = f"model.layers.{i}."
        ref = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        assert torch.allclose(t.layers[i].gate_up.dense(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
        ref = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.allclose(t.layers[i].qkv_w.dense(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    assert torch.equal(t.embed, sd["model.embed_tokens.weight"])


# ---- user surface ---------------------------------------------------------------------------------------------------

def test_cli_generate_quantized_matches_api_and_says_so(tmp_path):
    import subprocess
    import sys

    from tiny import save_tiny_text_model

    from peagle import LLM, SamplingParams
    model = save_tiny_text_model(str(tmp_path / "m"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "peagle.cli", "generate", "--model", model, "--prompt", "def foo(x):",
                        "--max-tokens", "12", "--quantization", "q8"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[target: quantization q8" in r.stderr
    want = LLM(model, quantization="q8").generate("def foo(x):", SamplingParams(temperature=0, max_tokens=12))
    assert r.stdout.rstrip("\n") == want[0].outputs[0].text
    for cmd in ("serve", "bench"):
        h = subprocess.run([sys.executable, "-m", "peagle.cli", cmd, "--help"], capture_output=True, text=True,
                           env=env, timeout=120)
        assert "--quantization" in h.stdout, cmd


def test_server_state_runs_the_quantized_target(qtarget):
    pytest.importorskip("fastapi")
    from peagle.server.start import build_state
    state = build_state(qtarget, "m", None, quantization="q4")
    assert state.engine.target.quantization == "q4" and "Q4_1" in state.engine.target.precision


def test_llm_runs_a_gguf_file(tiny_gguf):
    from peagle import LLM, SamplingParams
    llm = LLM(tiny_gguf, quantization="q4")
    assert "tiny.gguf" in llm.engine.target.precision
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_auto_quantization_resolves_per_model_and_machine(qtarget, tiny_gguf, capsys):
    """The default, "auto": q4a8 for a model that is a GGUF file's blocks (a .gguf path; the default target,
    converted from its package's file) where the AVX2 kernels run, else float weights; said on stderr. Not for
    a float checkpoint, another dtype or the transformers backend."""
    import torch

    from peagle import LLM
    from peagle.llm import DEFAULT_MODEL
    from peagle.models.loader import resolve_quantization
    fast = "q4a8" if EXT is not None and EXT.has_avx2() else "none"
    assert resolve_quantization(qtarget, "auto", "native", torch.float32, "cpu")[0] == "none"
    assert resolve_quantization(tiny_gguf, "auto", "native", torch.float32, "cpu")[0] == fast
    assert resolve_quantization(tiny_gguf, "auto", "native", torch.bfloat16, "cpu")[0] == "none"
    assert resolve_quantization(qtarget, "auto", "transformers", torch.float32, "cpu")[0] == "none"
    assert resolve_quantization(tiny_gguf, "q8", "native", torch.float32, "cpu")[0] == "q8"   # explicit: kept
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "conversion.json")):
        assert resolve_quantization(DEFAULT_MODEL, "auto", "native", torch.float32, "cpu")[0] == fast
    capsys.readouterr()
    assert LLM(qtarget).engine.target.quantization == "none"
    assert "quantization auto" not in capsys.readouterr().err          # float weights: nothing to announce
    assert LLM(tiny_gguf).engine.target.quantization == fast
    assert (f"quantization auto -> {fast}" in capsys.readouterr().err) == (fast != "none")


# ---- block- and batch-invariant attention (a8 targets) --------------------------------------------------------

ATT_IMPLS = ([1] + ([2] if EXT.has_avx2() else []) + ([3] if EXT.has_avx512() else [])) if EXT is not None else []


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
@pytest.mark.parametrize("impl", ATT_IMPLS)
def test_exact_attention_matches_sdpa_and_is_block_invariant(impl):
    """attend_exact vs float64 SDPA (GQA, causal block masks, a random tree-like mask), and a query's output is
    the same bits alone (T=1, no mask, S = its position + 1), inside a block of 4 with a longer span, and next
    to other rows; the generic and AVX2 builds agree bit for bit."""
    import torch.nn.functional as F

    from peagle.models.layers import causal_block_mask
    g = torch.Generator().manual_seed(4)
    B, nh, nkv, hd, S = 3, 6, 2, 40, 37
    k = torch.randn(B, nkv, S + 5, hd, generator=g)[:, :, :S]        # a cache view: strided like the engine's
    v = torch.randn(B, nkv, S + 5, hd, generator=g)[:, :, :S]
    for T, mask in ((1, None), (4, causal_block_mask(torch.tensor([30, 20, 33]), 4, S)),
                    (5, torch.rand(B, 1, 5, S, generator=g) < 0.6)):
        q = torch.randn(B, T, nh, hd, generator=g)
        got = Q.attend_exact(q, k, v, mask, impl)
        if mask is not None:
            mask[..., 0] = True                                         # every query sees a key
            got = Q.attend_exact(q, k, v, mask, impl)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.double(), v.double(), attn_mask=mask,
                                             enable_gqa=True).transpose(1, 2).reshape(B, T, nh * hd)
        assert torch.allclose(got.double(), ref, atol=2e-6), (T, float((got.double() - ref).abs().max()))
        if impl >= 2:
            assert torch.equal(got, Q.attend_exact(q, k, v, mask, 1))
    # invariance: row 1's query at position 21 (second of a block starting at 20)
    q = torch.randn(B, 4, nh, hd, generator=g)
    block = Q.attend_exact(q, k, v, causal_block_mask(torch.tensor([30, 20, 33]), 4, S), impl)
    alone = Q.attend_exact(q[1:2, 1:2], k[1:2, :, :22], v[1:2, :, :22], None, impl)
    assert torch.equal(block[1, 1], alone[0, 0])
    assert not torch.equal(Q.attend_exact(q[1:2, 1:2], k[1:2, :, :23], v[1:2, :, :23], None, impl)[0, 0],
                           alone[0, 0])                                 # negative control: one more key counts


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
@pytest.mark.parametrize("hd", [64, 128])
def test_blocked_attention_paths_agree_bit_for_bit(hd):
    """hd 64 / 128 take the blocked kernels (queries sharing a kv head in tasks of 8; AVX-512: two queries per
    register, eight keys per fold): the same bits as the generic build, with odd and even query counts per task,
    spans that are not multiples of 8 or 16, no mask, causal blocks and a random tree-like mask (a query that
    sees no key gives zeros). Negative control: one key more changes the output."""
    from peagle.models.layers import causal_block_mask
    g = torch.Generator().manual_seed(7)
    for B, T, nh, nkv, S0 in ((1, 1, 9, 3, 263), (2, 8, 9, 3, 37), (1, 3, 4, 2, 16), (3, 5, 6, 6, 9), (1, 16, 9, 3, 5)):
        S = S0 + T
        k = torch.randn(B, nkv, S + 3, hd, generator=g)[:, :, :S]
        v = torch.randn(B, nkv, S + 3, hd, generator=g)[:, :, :S]
        q = torch.randn(B, T, nh, hd, generator=g)
        tree = torch.rand(B, 1, T, S, generator=g) < 0.5
        tree[0, 0, 0] = False                                           # a query that sees nothing
        for mask in (None, causal_block_mask(torch.randint(0, S0 + 1, (B,), generator=g), T, S), tree):
            ref = Q.attend_exact(q, k, v, mask, 1)
            for impl in ATT_IMPLS[1:]:
                assert torch.equal(Q.attend_exact(q, k, v, mask, impl), ref), (B, T, nh, nkv, S0, impl)
        assert not torch.equal(Q.attend_exact(q, k[:, :, :-1], v[:, :, :-1], None, ATT_IMPLS[-1]),
                               Q.attend_exact(q, k, v, None, ATT_IMPLS[-1]))


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
def test_a8_target_gives_a_token_the_same_bits_in_any_block(qtarget, summary_note):
    """q4a8 forward: three tokens decoded one at a time as plain decoding does (no mask, s0) give the same
    logits and states, bit for bit, as the same tokens in one 3-token verify block (causal mask), so 8-bit
    rounding cannot tell plain decoding from verification. Negative control: with SDPA's attention instead
    (exact off), they differ on every CPU measured so far; SDPA's kernels differ per CPU, so where they happen
    to agree the control is reported, not failed."""
    from peagle.models.llama import Transformer
    t = Transformer.from_pretrained(qtarget, quantization="q4a8")
    g = torch.Generator().manual_seed(6)
    prompt, nxt = torch.randint(5, 500, (1, 40), generator=g), torch.randint(5, 500, (1, 3), generator=g)

    def prefilled():
        c = t.new_cache(1, 64)
        t.forward(prompt, c, 0, torch.zeros(1, dtype=torch.long), span=40, s0=0)
        c.lens[:1] = 40
        return c

    def both():
        c = prefilled()
        one = [t.forward(nxt[:, j:j + 1], c, 0, torch.tensor([40 + j]), aux_ids=(1, 2), span=41 + j, s0=40 + j)
               for j in range(3)]
        block = t.forward(nxt, prefilled(), 0, torch.tensor([40]), aux_ids=(1, 2), span=43)
        return ([torch.cat([lg[0, 0], ax[0, 0]]) for lg, ax in one],
                [torch.cat([block[0][0, j], block[1][0, j]]) for j in range(3)])
    alone, block = both()
    assert all(torch.equal(x, y) for x, y in zip(alone, block))
    t.exact_attention = False
    alone, block = both()
    if all(torch.equal(x, y) for x, y in zip(alone, block)):
        summary_note("a8 block invariance: SDPA agreed bit for bit on this CPU too (negative control not shown)")


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
def test_a8_trees_in_ragged_batches_stay_identical(qtarget):
    """q4a8 with an oracle tree proposer (deep accepted paths, KV compaction) in continuous batches of 3
    rows: every output equals plain q4a8 decoding, token for token."""
    from test_engine_lossless import ids, prompts
    from test_trees_engine import OracleTreeProposer, tree_llm

    from peagle import LLM, SamplingParams
    ps = prompts(7, seed=21)
    full = ids(LLM(qtarget, quantization="q4a8").generate(ps, SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True)))
    prop = OracleTreeProposer(4, {tuple(p["prompt_token_ids"]): f for p, f in zip(ps, full)}, 0.15, 0)
    llm = tree_llm(qtarget, prop, 4, 3, 12, quantization="q4a8", max_num_seqs=3)
    assert ids(llm.generate(ps, SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))) == \
        [f[:23] for f in full]
    assert llm.get_metrics()["mean_acceptance_length"] > 1.5
