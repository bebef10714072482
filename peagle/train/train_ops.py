"""The drafter heads' RMSNorm and SwiGLU in bfloat16 training on a CPU: one C++ pass forward and one back each.

Invariant: ``rms_norm(x, w, eps)`` is x / sqrt(mean(x^2) + eps) * w and ``swiglu(a, b)`` is silu(a) * b, computed in
float32 from the inputs and rounded once to bfloat16, with the gradients of those formulas (of x, a and b in their
dtypes, the norm's weight in float32); the tests hold both paths to float64 with negative controls. The C++ path
(peagle/csrc/train_ops*.cpp) runs on AVX-512 CPUs with the extension; elsewhere torch ops of the same formulas.

Why (docs/training-study/train-cost.md): autograd runs F.rms_norm's backward and silu * mul of the split gate/up
product as several elementwise passes each over [tokens, width] tensors, a tenth of a P-EAGLE row step.
``install_ops(head)`` puts them under the head's RMSNorm and MLP modules for bfloat16 autocast on a CPU (the Trainer's
bfloat16 path, beside train_linear's products); handles' remove() undoes it."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..heads.model import MLP, RMSNorm
from .train_linear import BF16, Installed, bf16_autocast

USE_KERNEL = True   # False: the torch formulas everywhere (A/B runs, tests)


def _kernel(x: torch.Tensor):
    """The extension when it runs these ops on x, else None."""
    if not USE_KERNEL or x.device.type != "cpu" or x.shape[-1] % 16 or x.dtype not in (torch.float32, BF16):
        return None
    from ..models import quant_ext
    return quant_ext.avx512()


class _RMSNorm(torch.autograd.Function):
    """x [.., H] float32 or bfloat16, w [H] float32 -> bfloat16 [.., H] (peagle/csrc/train_ops.cpp)."""

    @staticmethod
    def forward(ctx, x, w, eps, ext):
        x2 = x.reshape(-1, x.shape[-1])
        y, r = ext.rms_norm_forward(x2, w.detach(), eps)      # [R, H] bf16, [R] = 1 / rms
        ctx.save_for_backward(x2, w, r)
        ctx.ext, ctx.shape = ext, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, w, r = ctx.saved_tensors
        dx, dw = ctx.ext.rms_norm_backward(x2, w.detach(), r, g.reshape(x2.shape))
        return dx.view(ctx.shape), dw, None, None


class _SwiGLU(torch.autograd.Function):
    """a, b [.., I] bfloat16 (unit column stride; e.g. the halves of one gate/up product) -> bfloat16 [.., I]."""

    @staticmethod
    def forward(ctx, a, b, ext):
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        ctx.save_for_backward(a2, b2)
        ctx.ext, ctx.shape = ext, a.shape
        return ext.swiglu_forward(a2, b2).view(a.shape)

    @staticmethod
    def backward(ctx, dh):
        a2, b2 = ctx.saved_tensors
        da, db = ctx.ext.swiglu_backward(a2, b2, dh.reshape(a2.shape).to(BF16))
        return da.view(ctx.shape), db.view(ctx.shape), None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [.., H] -> bfloat16 [.., H] (see the module docstring)."""
    ext = _kernel(x)
    if ext is not None and w.dtype == torch.float32:
        return _RMSNorm.apply(x, w, float(eps), ext)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(BF16)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b -> bfloat16 (see the module docstring)."""
    ext = _kernel(a)
    if ext is not None and a.dtype == BF16 and b.dtype == BF16 and a.stride(-1) == 1 and b.stride(-1) == 1 \
            and a.shape == b.shape:
        return _SwiGLU.apply(a, b, ext)
    return (F.silu(a.float()) * b.float()).to(BF16)


def _norm_forward(mod: RMSNorm, x):
    return rms_norm(x, mod.weight, mod.eps) if bf16_autocast(x) else RMSNorm.forward(mod, x)


def _mlp_forward(mod: MLP, x):
    if not bf16_autocast(x):
        return MLP.forward(mod, x)
    a, b = mod.project(x)
    return mod.down_proj(swiglu(a, b))


def install_ops(module: torch.nn.Module) -> list:
    """Every RMSNorm and MLP of `module` takes rms_norm / swiglu under CPU bfloat16 autocast. Returns handles
    whose remove() undoes it."""
    handles = []
    for m in module.modules():
        fwd = _norm_forward if isinstance(m, RMSNorm) else _mlp_forward if isinstance(m, MLP) else None
        if fwd is not None:
            m.forward = partial(fwd, m)
            handles.append(Installed(m, ("forward",)))
    return handles
