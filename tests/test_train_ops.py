"""peagle/train/train_ops.py: the bfloat16 training RMSNorm and SwiGLU (C++ passes, torch formulas elsewhere)
against float64 references, with negative controls."""
import pytest
import torch
import torch.nn.functional as F

from peagle.models import quant_ext
from peagle.train import train_ops as to

HAS_KERNEL = quant_ext.avx512() is not None
PATHS = [pytest.param(True, marks=pytest.mark.skipif(not HAS_KERNEL, reason="the C++ path needs AVX-512")), False]


def _rel(a, b):
    return float((a.detach().double() - b).abs().max() / b.abs().max())


def _norm64(x, w, eps, g):
    """float64 RMSNorm of the same values: (y, dx, dw)."""
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    y.backward(g.double())
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_float64(kernel, dtype, monkeypatch):
    """Values and gradients of x (bfloat16 or float32 rows, 3-D, 130 rows: more than one 64-row chunk) and of the
    weight within bfloat16 rounding of float64; the C++ path really runs. Negative controls: the reference of
    another weight, and of another row's output gradient, differ."""
    monkeypatch.setattr(to, "USE_KERNEL", kernel)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 65, 48, generator=gen) * 3).to(dtype)
    w, g = torch.rand(48, generator=gen) + 0.5, torch.randn(2, 65, 48, generator=gen).bfloat16()
    assert (to._kernel(x) is not None) == kernel
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = to.rms_norm(xg, wg, 1e-5)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and xg.grad.dtype == dtype and wg.grad.dtype == torch.float32
    ry, rdx, rdw = _norm64(x, w, 1e-5, g)
    assert _rel(y, ry) < 8e-3 and _rel(wg.grad, rdw) < 1e-4 and _rel(xg.grad, rdx) < (8e-3 if dtype != torch.float32 else 1e-4)
    oy, _, _ = _norm64(x, w.roll(1), 1e-5, g)
    _, odx, odw = _norm64(x, w, 1e-5, g.roll(1, 1))
    assert _rel(y, oy) > 0.05 and _rel(xg.grad, odx) > 0.05 and _rel(wg.grad, odw) > 0.05


@pytest.mark.parametrize("kernel", PATHS)
def test_rms_norm_keeps_eps_for_small_rows(kernel, monkeypatch):
    """eps sits inside the root: rows whose mean square is near or below it (1e-3-scaled rows, an all-zero row:
    y = 0 and dx = 0, not NaN) match float64 with eps, values and gradients. test_rms_norm_matches_float64's rows
    (mean square ~9) cannot tell eps from none. Negative control: the reference without eps differs."""
    monkeypatch.setattr(to, "USE_KERNEL", kernel)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 48, generator=gen) * torch.tensor([1e-3, 3e-3, 1.0, 0.0])[:, None]
    w, g = torch.rand(48, generator=gen) + 0.5, torch.randn(4, 48, generator=gen).bfloat16()
    assert (to._kernel(x) is not None) == kernel
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = to.rms_norm(xg, wg, 1e-5)
    y.backward(g)
    assert torch.isfinite(y.float()).all() and torch.isfinite(xg.grad).all() and y[3].abs().sum() == 0
    ry, rdx, rdw = _norm64(x, w, 1e-5, g)
    assert _rel(y, ry) < 8e-3 and _rel(wg.grad, rdw) < 1e-4 and _rel(xg.grad, rdx) < 1e-4
    oy, _, _ = _norm64(x[:3], w, 0.0, g[:3])
    assert _rel(y[:3], oy) > 0.05


@pytest.mark.parametrize("kernel", PATHS)
def test_swiglu_matches_float64(kernel, monkeypatch):
    """silu(a) * b of the two halves of one [rows, 2I] bfloat16 product (strided views, as the grouped gate/up
    gives them) and its gradients within bfloat16 rounding of float64, large |a| included (the sigmoid never
    overflows). Negative control: the halves swapped."""
    monkeypatch.setattr(to, "USE_KERNEL", kernel)
    gen = torch.Generator().manual_seed(1)
    gu = (torch.randn(1, 70, 96, generator=gen) * 4).bfloat16()
    gu[0, 0, :4] = torch.tensor([90.0, -90.0, 0.0, -0.0])
    dh = torch.randn(1, 70, 48, generator=gen).bfloat16()
    leaf = gu.clone().requires_grad_()
    a, b = leaf.split(48, -1)
    assert (to._kernel(a) is not None) == kernel
    h = to.swiglu(a, b)
    h.backward(dh)
    r = gu.double().requires_grad_()
    ra, rb = r.split(48, -1)
    rh = F.silu(ra) * rb
    rh.backward(dh.double())
    assert h.dtype == torch.bfloat16 and _rel(h, rh.detach()) < 8e-3 and _rel(leaf.grad, r.grad) < 8e-3
    assert torch.isfinite(leaf.grad.float()).all()
    assert _rel(h, (F.silu(rb) * ra).detach()) > 0.05


def test_head_step_with_fused_ops(tiny_dirs, monkeypatch):
    """A P-EAGLE head's bfloat16 row step with the installed norms and SwiGLU (beside the installed linears) gives
    the loss and gradients of autocast's ops within bfloat16 rounding; removing the handles restores the modules
    and leaves the linears' installs.
    Negative control: SwiGLU with its halves swapped."""
    from heads import training_head
    from test_train_peagle import random_row

    from peagle.train import train_linear as tl
    from peagle.train.mask import MaskTable
    from peagle.train.peagle_loss import make_elements, row_step
    head = training_head(tiny_dirs["llama"])
    tl.install_linears(head)

    def step():
        head.zero_grad(set_to_none=True)
        row = random_row(seed=3)
        el = make_elements(row, 8, gen=torch.Generator().manual_seed(0))
        st = row_step(head, row, el, MaskTable(128), 8, float(el["sup"].sum()), 32, autocast_dtype=torch.bfloat16)
        return st["kl"], torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
    kl_ref, g_ref = step()
    handles = to.install_ops(head)
    assert len(handles) == 3 * len(head.layers) + 2     # per layer two norms and the MLP; hidden and final norms
    kl, grad = step()
    err = float((grad - g_ref).norm() / g_ref.norm())
    assert abs(kl - kl_ref) <= 1e-2 * abs(kl_ref) and err < 0.03, err
    real = to.swiglu
    monkeypatch.setattr(to, "swiglu", lambda a, b: real(b, a))
    assert float((step()[1] - g_ref).norm() / g_ref.norm()) > 10 * err
    for h in handles:
        h.remove()
    assert not any("forward" in m.__dict__ for m in head.modules() if isinstance(m, (to.RMSNorm, to.MLP)))
    assert all("project" in L.mlp.__dict__ for L in head.layers)     # the linears' own installs stay
