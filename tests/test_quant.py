"""Weight-only quantized linears (peagle/models/quant.py, peagle/csrc/): the kernels against a dequantized float
reference, batch invariance (a row's result bit-identical whatever the other rows), every vector path against
the scalar one bit for bit, the quantizers against gguf's, and the fused small ops against torch's. Every kernel
test runs on the torch fallback and, where the C++ extension is built (`make setup`), on each path the CPU has.
Targets built on these: test_quant_target.py, test_gguf_target.py, test_exact_attention.py."""
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
    # larger calls run the same per-row arithmetic at any row count (the kernel in passes of KERNEL_MAX_ROWS;
    # the fallback up to KERNEL_MAX_ROWS): a verify block of B x (K+1) > 128 rows computes what B plain steps do
    n = 9 if impl >= 0 else 5                                         # 144 rows: past KERNEL_MAX_ROWS
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


@pytest.mark.skipif(EXT is None or not EXT.has_avx512(), reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("qtype", TYPES)
def test_the_avx2_paths_dpbusd_and_maddubs_forms_give_the_scalar_bits(qtype):
    """Where the CPU has AVX-512 VNNI, the AVX2 path's 8-bit products sum each lane's byte products with dpbusd
    on ymm (quant_a8_vnni256.cpp; split over several accumulators at 1-3 rows), else with maddubs + madd: the
    same exact integers, so both forms give the scalar path's bits at every row count of the AVX2 path's tiles
    (1-4 rows and remainders), 37 outputs (a partial group); codes at their extremes included."""
    assert EXT.avx2_vnni()                               # the default on such a CPU
    g = torch.Generator().manual_seed(8)
    x = torch.randn(11, 256, generator=g)
    x[0] = 0.0
    x[1], x[2] = 1e3, -1e3                               # every activation code at +127 / -127
    x[3, ::2], x[3, 1::2] = 1e3, -1e3
    for w in (random_blocks(qtype, 37, 256, seed=4, act8=True), extreme_blocks(qtype, 37, 256)):
        try:
            for vnni in (True, False):
                EXT.set_avx2_vnni(vnni)
                assert EXT.avx2_vnni() == vnni
                for m in (1, 2, 3, 4, 5, 6, 7, 11):
                    assert torch.equal(Q.qmm(x[:m], w, 2), Q.qmm(x[:m], w, 1)), (vnni, m)
        finally:
            EXT.set_avx2_vnni(True)


def extreme_blocks(qtype, n, k, seed=6):
    """Blocks whose codes sit at the integer sums' limits (8-bit activations): Q4 nibbles all 15 (a 16-bit
    maddubs sum of 8 x 2 x 15 x 127 = 30,480 against +-127 activations), Q8_0 codes -128 (the sign trick's
    |w| = 128) in the first half of the outputs and +127 in the rest; random scales."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    d = ((torch.rand(n, nb, 1, generator=g) - 0.5) * 0.2).half().view(torch.uint8).reshape(n, nb, 2)
    if qtype == Q.Q8_0:
        q = torch.full((n, nb, 32), 0x7F, dtype=torch.uint8)
        q[: n // 2] = 0x80
        body = [d, q]
    else:
        m = ((torch.rand(n, nb, 1, generator=g) - 0.5) * 0.5).half().view(torch.uint8).reshape(n, nb, 2)
        body = [d] + ([m] if qtype == Q.Q4_1 else []) + [torch.full((n, nb, 16), 0xFF, dtype=torch.uint8)]
    return Q.QuantWeight(torch.cat(body, -1).reshape(n, -1), qtype, n, k, act8=True)


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
        x[0, 32:64] = 0.0                                # amax / 127 below float's normal range: 1 / xd is inf,
        x[0, 32:34] = torch.tensor([3e-37, -1.5e-37])    # so the block quantizes to zeros (it gave +-127 and NaN)
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


def test_many_rows_give_the_float_product():
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


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the extension's AVX2 path")
def test_silu_mul_scalar_path_gives_the_vector_paths_bits():
    """silu_mul on a CPU without AVX2 took libm's expf where the vector path takes peagle's own e^x: other bits
    (1 ulp on ~5 % of elements, -0.0 for e^-a past float's range), so such a CPU's forward differed from a plain
    step's on another path. Both take one e^x now (exp1_inline.h)."""
    g = torch.Generator().manual_seed(5)
    a = torch.cat([torch.linspace(-120, 120, 2001), torch.randn(3000, generator=g) * 8,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5, 87.0, -87.0, float("inf"), -float("inf")])])
    gu = torch.cat([a, torch.randn(a.numel(), generator=g)]).reshape(1, -1)
    assert torch.equal(EXT.silu_mul(gu, 1).view(torch.int32), EXT.silu_mul(gu, 2).view(torch.int32))


def test_fused_ops_match_torch():
    g = torch.Generator().manual_seed(4)
    x, h, wt = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.rand(64, generator=g) + 0.5
    s, n = Q.add_rms_norm(x, h, wt, 1e-5)
    assert torch.equal(s, x + h)
    assert torch.allclose(n, torch.nn.functional.rms_norm(x + h, (64,), wt, 1e-5), atol=1e-5)
    with pytest.raises(RuntimeError):                   # a short weight: refused, not read past its end
        Q.add_rms_norm(x, h, wt[:32], 1e-5)
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
def test_rms_norm_takes_add_rms_norms_sums_bit_for_bit():
    """rms_norm(x) is add_rms_norm(x, 0)'s normed output bit for bit (ops.h: the same sums of squares in float64,
    eps inside the root, one float32 inverse), so a drafter's norms (heads/model.py) round as the target's fused
    ones. Reference: that arithmetic written out (rows from 1e-3 to 1e3: eps counts in the small ones); a float32
    sum of squares gave other bits here while test_fused_ops_match_torch's tolerance let it pass."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 576, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    w = torch.rand(576, generator=g) + 0.5
    got = EXT.rms_norm(x, w, 1e-5)
    assert torch.equal(got, EXT.add_rms_norm(x, torch.zeros_like(x), w, 1e-5)[1])
    inv = (1.0 / torch.sqrt(x.double().pow(2).sum(-1, keepdim=True) / x.shape[-1] + 1e-5)).float()
    assert torch.equal(got, x * inv * w)
    assert not torch.equal(got, EXT.rms_norm(x, w, 1e-6))          # negative control: eps is read


@pytest.mark.skipif(EXT is None or not EXT.has_avx2(), reason="needs the built extension on an AVX2 CPU")
def test_quantize_act_gives_nan_and_inf_the_scalar_paths_bits():
    """quantize_act's rule for odd activations, the same on every path: a NaN drops out of its block's amax and
    quantizes to 127 (fmax / fmin's rule, which the AVX2 path gets from its operand order), at any lane of a
    block; an inf makes its block's scale inf (the others 0, the inf 127). A NaN reaching the AVX2 path's amax
    (scale NaN) or its clamp (-127) passed every other test."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 256, generator=g)
    for r, j in ((0, 0), (0, 39), (0, 71), (1, 127), (1, 200), (2, 255)):    # lanes 0-7 of a block, every block end
        x[r, j] = float("nan")
    x[2, 64 + 5] = float("inf")
    x[2, 96 + 3] = -float("inf")
    q1, d1, s1 = EXT.quantize_act(x, 1)
    assert q1[0, 0] == 127 and q1[1, 127] == 127 and torch.isfinite(d1[0]).all() and d1[2, 2] == float("inf")
    for impl in IMPLS[2:]:
        q, d, s = EXT.quantize_act(x, impl)
        assert torch.equal(q, q1) and torch.equal(d.view(torch.int32), d1.view(torch.int32)), impl
        assert torch.equal(s.view(torch.int32), s1.view(torch.int32)), impl


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
def test_cache_slot_checks_hold_at_the_exact_boundary():
    """The checks in front of the cache writes are exact: rope_kv writes position cap - 1 and refuses cap (one
    slot past the row: the next head's or row's entries, or past the buffer), compact_kv takes start + max(i,
    path) = cap - 1 and refuses cap. test_bad_arguments_to_the_extension probes far outside only, which let a
    check one off (<= cap) through."""
    nh, nkv, hd, cap = 2, 1, 8, 4
    kc, vc = torch.zeros(1, nkv, cap, hd), torch.zeros(1, nkv, cap, hd)
    qkv, cos, sin = torch.ones(1, 1, (nh + 2 * nkv) * hd), torch.ones(1, 1, hd), torch.zeros(1, 1, hd)
    EXT.rope_kv(qkv, cos, sin, kc, vc, 0, torch.tensor([[cap - 1]]), nh, nkv)
    assert kc[0, 0, cap - 1].abs().sum() > 0 and kc[0, 0, :cap - 1].abs().sum() == 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        EXT.rope_kv(qkv, cos, sin, kc, vc, 0, torch.tensor([[cap]]), nh, nkv)
    k = torch.arange(cap * hd, dtype=torch.float32).view(1, 1, cap, hd)
    a = k.clone()
    EXT.compact_kv([a], [a.clone()], 0, torch.tensor([1]), torch.tensor([[0, 2]]))   # slots 1, 3 -> 1, 2
    assert torch.equal(a[0, 0, 2], k[0, 0, 3])
    for start, path in ((1, [0, 3]), (3, [0, 0]), (2, [2, 1])):                      # a slot at cap, each way
        with pytest.raises(RuntimeError, match="slot outside"):
            EXT.compact_kv([k.clone()], [k.clone()], 0, torch.tensor([start]), torch.tensor([path]))


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


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
def test_bad_arguments_to_the_extension_raise_instead_of_writing_outside_buffers():
    """Found by a review, each a crash or a write past a buffer before: a zero-wide row divided by zero
    (SIGFPE), a negative or overflowing cache row / slot wrote outside the cache, a LayerStack whose layers
    differ in intermediate size overran its scratch, a head size not a multiple of 8 overran a vector store."""
    assert EXT.rms_norm(torch.zeros(3, 0), torch.zeros(0), 1e-6).shape == (3, 0)
    assert EXT.add_rms_norm(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(0), 1e-6)[1].shape == (3, 0)
    assert EXT.silu_mul(torch.zeros(3, 0)).shape == (3, 0)
    nh, nkv, hd, cap = 2, 1, 8, 4
    base = torch.zeros(3, nkv, cap, hd)
    kc, vc = base[1:], torch.zeros(2, nkv, cap, hd)
    qkv, cos, sin = torch.ones(1, 1, (nh + 2 * nkv) * hd), torch.ones(1, 1, hd), torch.zeros(1, 1, hd)
    with pytest.raises(RuntimeError, match="rope_kv: caches"):
        EXT.rope_kv(qkv, cos, sin, kc, vc, -1, torch.zeros(1, 1, dtype=torch.long), nh, nkv)
    EXT.rope_kv(qkv, cos, sin, kc, vc, 0, torch.zeros(1, 1, dtype=torch.long), nh, nkv)        # the control
    assert base[0].abs().sum() == 0 and base[1].abs().sum() > 0
    k = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="slot outside"):
        EXT.compact_kv([k], [k.clone()], 0, torch.tensor([2 ** 62 + 10 ** 8]), torch.tensor([[2 ** 62]]))
    with pytest.raises(RuntimeError, match="compact_kv: caches"):
        EXT.compact_kv([k], [k.clone()], -1, torch.tensor([0]), torch.tensor([[1]]))

    def stack(Is, nh=1, nkv=1, hd=32, H=32):
        ws = [Q.quantize(torch.randn(N, K) * 0.05, Q.Q8_0) for inter in Is
              for N, K in (((nh + 2 * nkv) * hd, H), (H, nh * hd), (2 * inter, H), (H, inter))]
        return EXT.LayerStack(ws, [], False, [Q.Q8_0] * len(ws), [torch.ones(H)] * (2 * len(Is) + 1), nh, nkv, hd, 1e-6, 0)
    assert stack([32, 32]) is not None
    with pytest.raises(RuntimeError, match="intermediate size"):
        stack([32, 4096])
    with pytest.raises(RuntimeError, match="head_dim"):
        stack([32], nh=8, nkv=8, hd=4)
    with pytest.raises(RuntimeError, match="head_dim"):
        stack([32], nh=2, nkv=0)


@pytest.mark.skipif(EXT is None, reason="needs the built extension")
def test_a_stale_build_is_not_loaded(tmp_path, monkeypatch):
    """A build whose recorded source hash is not the sources' (peagle/csrc/ changed since) must not run: it would
    compute with the old kernels. The same build with the current hash loads (the control)."""
    import json
    so = os.path.join(quant_ext.BUILD_DIR, quant_ext.NAME + ".so")
    os.symlink(so, tmp_path / (quant_ext.NAME + ".so"))
    monkeypatch.setattr(quant_ext, "BUILD_DIR", str(tmp_path))
    stamp = tmp_path / quant_ext.STAMP
    stamp.write_text(json.dumps({"sources_sha256": quant_ext.source_hash()}))
    mod, why = quant_ext._load()
    assert mod is not None and why is None, why
    stamp.write_text(json.dumps({"sources_sha256": "0" * 64}))
    mod, why = quant_ext._load()
    assert mod is None and "stale" in why
