"""peagle/train/train_linear.py: the heads' bfloat16 training linears against torch's linear under autocast and a
float64 reference, with negative controls; the transposing copy (C++ on AVX-512 CPUs, torch elsewhere) exact."""
import pytest
import torch
import torch.nn.functional as F

from peagle.models import quant_ext
from peagle.train import train_linear as tl

ext = quant_ext.get()
HAS_KERNEL = quant_ext.avx512() is not None


@pytest.mark.parametrize("kernel", [True, False])
def test_transpose_pad_is_exact(kernel, monkeypatch):
    """src^T with rows R..rows_pad-1 zero, float32 / bfloat16 in and out (bfloat16 written from float32 rounds
    to nearest even: torch's cast), R not a multiple of 16, through the C++ pass or torch's copy."""
    if kernel and not HAS_KERNEL:
        with pytest.raises(RuntimeError, match="no AVX-512"):
            ext.transpose_pad(torch.zeros(16, 16), 16, False)
        return
    if not kernel:
        monkeypatch.setattr(quant_ext, "get", lambda: None)
    g = torch.Generator().manual_seed(0)
    for R, C in ((1, 16), (37, 48), (130, 96)):
        for src in (torch.randn(R, C, generator=g), torch.randn(R, C, generator=g).bfloat16()):
            for to_f32 in (False, True):
                out = tl._transpose(src, R + (-R % 16) + 16, to_f32)
                want = src.t().to(torch.float32 if to_f32 else torch.bfloat16)
                assert out.shape == (C, R + (-R % 16) + 16) and torch.equal(out[:, :R], want)
                assert not out[:, R:].any()


@pytest.mark.skipif(not HAS_KERNEL, reason="needs the extension's AVX-512 path")
def test_bfloat16_narrowing_keeps_a_nan_a_nan():
    """float32 -> bfloat16 in the AVX-512 kernels rounded a NaN's payload into its exponent (0x7fffffff -> -0.0,
    0x7f800001 -> inf): a NaN in training turned into a number. Now torch's cast: NaN stays NaN, the rest
    rounds to nearest even (the largest float to inf, as torch)."""
    bits = torch.tensor([0x7FC00000, 0x7FFFFFFF, -1, 0x7FFF8000, 0x7F808000, 0x7F800001, 0x7F7FFFFF, 0x3F808000],
                        dtype=torch.int64).to(torch.int32)
    src = torch.zeros(16, 16)
    src[0, :8] = bits.view(torch.float32)
    got, want = ext.transpose_pad(src, 16, False)[:8, 0].float(), bits.view(torch.float32).bfloat16().float()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])


def _grads(lin, x, w_coef):
    """(y, dx, dW) of lin(x) under bfloat16 autocast with loss sum(y * w_coef), w_coef [.., out] per row."""
    lin.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    (y.float() * w_coef).sum().backward()
    return y.detach(), x.grad, lin.weight.grad


def _ref64(W, x, w_coef):
    """float64 products of the bfloat16-rounded operands: (y, dx, dW)."""
    xd, Wd = x.detach().bfloat16().double(), W.detach().bfloat16().double()
    gd = w_coef.double().bfloat16().double()
    g2, x2 = gd.reshape(-1, W.shape[0]), xd.reshape(-1, W.shape[1])
    return xd @ Wd.t(), (g2 @ Wd).view(x.shape), g2.t() @ x2


@pytest.mark.parametrize("shape", [(48, 32), (32, 512)])   # g^T the smaller copy; x^T and the result (LM head)
@pytest.mark.parametrize("rows", [(1, 37), (100,), (2, 64)])
def test_linear_equals_autocast_linear(shape, rows):
    """Values and gradients of an installed linear = torch's linear under bfloat16 autocast, both within bf16
    rounding of the float64 products, for a float32 input of rows that are and are not a multiple of 64 (both
    weight-gradient forms run). Negative control: the weight gradient of rows shifted by one is far off."""
    n_in, n_out = shape
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(*rows, n_in, generator=g)
    w_coef = torch.randn(*rows, n_out, generator=g)
    ref = _grads(lin, x, w_coef)
    handles = tl.install_linears(lin)
    got = _grads(lin, x, w_coef)
    want = _ref64(lin.weight, x, w_coef)
    for name, a, b, r in zip(("y", "dx", "dW"), got, ref, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        scale = float(r.abs().max())
        err_got, err_ref = float((a.double() - r).abs().max()), float((b.double() - r).abs().max())
        assert err_got <= max(2 * err_ref, 1e-2 * scale), (name, err_got, err_ref, scale)
    shifted = _ref64(lin.weight, x.roll(1, -2), w_coef)[2]
    assert float((got[2].double() - shifted).abs().max()) > 0.1 * float(shifted.abs().max())
    for h in handles:
        h.remove()
    assert torch.equal(_grads(lin, x, w_coef)[2], ref[2])     # removed: torch's linear again


def test_linear_follows_weight_updates_and_dtypes():
    """The cached bfloat16 weight follows an in-place update (an optimizer step); a bfloat16 input keeps its
    dtype in the gradient, an input that needs no gradient gets none; outside autocast it is F.linear bit for
    bit; a linear with a bias is left to torch."""
    g = torch.Generator().manual_seed(2)
    lin, biased = torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(64, 48)
    tl.install_linears(torch.nn.ModuleList([lin, biased]))
    assert "forward" in lin.__dict__ and "forward" not in biased.__dict__
    x = torch.randn(70, 64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0 = lin(x)
        with torch.no_grad():
            lin.weight.mul_(-2)
        y1 = lin(x)
    assert torch.allclose(y1.float(), -2 * y0.float(), rtol=2e-2, atol=1e-2)
    xb = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xb)
    y.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().sum().backward()                    # x needs no gradient
    assert lin.weight.grad is not None and x.grad is None
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_head_step_with_grouped_products(tiny_dirs):
    """A P-EAGLE head's bfloat16 row step (segments, deep blocks) with the installed linears, q/k/v and gate/up
    each run as one product, gives the loss and gradients of torch's linears under autocast within bfloat16
    rounding; another row's gradients are far off (negative control); removing the handles restores the head."""
    from heads import training_head
    from test_train_peagle import random_row

    from peagle.train.mask import MaskTable
    from peagle.train.peagle_loss import make_elements, row_step
    head = training_head(tiny_dirs["llama"])

    def step(seed):
        head.zero_grad(set_to_none=True)
        row = random_row(seed=seed)
        el = make_elements(row, 8, gen=torch.Generator().manual_seed(0))
        st = row_step(head, row, el, MaskTable(128), 8, float(el["sup"].sum()), 32, autocast_dtype=torch.bfloat16)
        return st["kl"], torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
    kl_ref, g_ref = step(3)
    handles = tl.install_linears(head)
    kl, grad = step(3)
    for L in head.layers:
        assert set(L.self_attn.q_proj._bf16_weights) == {3} and set(L.mlp.gate_proj._bf16_weights) == {2}
    assert abs(kl - kl_ref) <= 1e-2 * abs(kl_ref) and grad.shape == g_ref.shape
    err = float((grad - g_ref).norm() / g_ref.norm())
    other = float((step(4)[1] - g_ref).norm() / g_ref.norm())
    assert err < 0.03 and other > 10 * err, (err, other)
    for h in handles:
        h.remove()
    assert not any("project" in m.__dict__ or "forward" in m.__dict__ for m in head.modules())


def test_padded_linear_rows_keep_values_and_gradients():
    """pad_linear_rows: a head's products over rows padded to a multiple give its unpadded outputs and
    gradients (to float rounding: the kernels may sum by shape), and the hooks really pad (a product sees a
    multiple of 64 rows); removing them restores the plain module."""
    from peagle.train.train_linear import pad_linear_rows
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8))
    x = torch.randn(1, 37, 16, requires_grad=True)

    def run():
        net.zero_grad(set_to_none=True)
        x.grad = None
        y = net(x)
        (y * torch.linspace(-1, 1, 8)).sum().backward()
        return y.detach(), x.grad.clone(), net[0].weight.grad.clone()
    ref = run()
    seen = []
    probe = net[2].register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-2]))
    handles = pad_linear_rows(net, 64)
    got = run()
    assert seen == [64] and got[0].shape == ref[0].shape
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())
    for h in handles + [probe]:
        h.remove()
    seen.clear()
    net[2].register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-2]))
    run()
    assert seen == [37]
