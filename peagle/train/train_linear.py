"""The drafter heads' linears in bfloat16 training on a CPU (the Trainer installs them under bfloat16 autocast).

Invariant: an installed nn.Linear (no bias) computes what ``F.linear`` computes under bfloat16 autocast -- the
output ``bf16(x) @ bf16(W)^T``, and the gradients of x and W of those bfloat16 products, W's rounded to bfloat16
as autocast's cast backward leaves it -- up to the order of the products' sums, which the tests hold to the
autocast reference with negative controls. Outside autocast it is ``F.linear``.

Why (measured in docs/training-study/train-cost.md): oneDNN's bfloat16 products on a CPU
- build a kernel per new shape (~4 ms for [900 x 576] x [576 x 1536] against 1.6 ms to run it), so token rows
  are padded with zeros to a multiple of ``PAD_ROWS`` and a run sees a few shapes;
- run 2-3x slower with a transposed left operand, the form of a weight gradient g^T x: it is computed from a
  row-major copy of g^T, or as (x^T g)^T when x^T and the transposed result are the smaller copies (the LM
  head), written by the extension's transposing pass (csrc/transpose_avx512.cpp; torch's copy elsewhere);
- and autocast casts every weight again in each autocast region: here once per weight version.
``pad_linear_rows`` is the padding alone around torch's own linear (the previous path, kept for A/B runs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_ROWS = 64     # token rows of every head product padded to a multiple of this
BF16 = torch.bfloat16


def _transpose(x: torch.Tensor, rows_pad: int, to_float32: bool = False) -> torch.Tensor:
    """x [R, C] (contiguous) -> [C, rows_pad] in bfloat16 (or float32), zero from column R."""
    from ..models import quant_ext
    ext = quant_ext.get()
    R, C = x.shape
    if ext is not None and ext.has_avx512() and C % 16 == 0 and rows_pad % 16 == 0:
        return ext.transpose_pad(x, rows_pad, to_float32)
    out = torch.zeros(C, rows_pad, dtype=torch.float32 if to_float32 else BF16, device=x.device)
    out[:, :R] = x.t()
    return out


def _weight_bf16(mod: torch.nn.Linear) -> torch.Tensor:
    """mod.weight in bfloat16, cast again only when the weight changed (its version counter moved)."""
    w = mod.weight
    key = (w._version, w.data_ptr())
    cached = getattr(mod, "_bf16_weight", None)
    if cached is None or cached[0] != key:
        cached = (key, w.detach().to(BF16))
        mod._bf16_weight = cached
    return cached[1]


class _Linear(torch.autograd.Function):
    """x [.., in] (any float dtype), w [out, in] float32 -> bf16 [.., out]; see the module docstring."""

    @staticmethod
    def forward(ctx, x, w, mod):
        n_in = x.shape[-1]
        x2 = x.reshape(-1, n_in)
        n = x2.shape[0]
        pad = -(-n // PAD_ROWS) * PAD_ROWS
        xb = torch.empty(pad, n_in, dtype=BF16, device=x.device)   # [pad, in]: x's rows, then zeros
        xb[:n].copy_(x2)
        xb[n:].zero_()
        wb = _weight_bf16(mod)                                     # [out, in]
        y = torch.mm(xb, wb.t())[:n]                               # [n, out]
        ctx.save_for_backward(xb, wb)
        ctx.n, ctx.x_shape, ctx.x_dtype = n, x.shape, x.dtype
        return y.view(*x.shape[:-1], wb.shape[0])

    @staticmethod
    def backward(ctx, g):
        xb, wb = ctx.saved_tensors
        n, (pad, n_in), n_out = ctx.n, xb.shape, wb.shape[0]
        gp = torch.empty(pad, n_out, dtype=BF16, device=g.device)  # [pad, out]
        gp[:n].copy_(g.reshape(-1, n_out))
        gp[n:].zero_()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(gp, wb)[:n].to(ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if pad * n_out <= pad * n_in + n_in * n_out:     # g^T [out, pad] is the smaller copy
                gw = torch.mm(_transpose(gp, pad), xb).float()                   # [out, in]
            else:                                            # x^T [in, pad] and the [in, out] result
                gw = _transpose(torch.mm(_transpose(xb, pad), gp), n_in, True)   # [out, in]
        return gx, gw, None


def _forward(mod: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16:
        with torch.autocast("cpu", enabled=False):
            return _Linear.apply(x, mod.weight, mod)
    return F.linear(x, mod.weight)


class _Installed:
    """Undoes install_linears on one module (the handle's remove(), as torch's hooks have)."""

    def __init__(self, mod):
        self.mod = mod

    def remove(self):
        self.mod.__dict__.pop("forward", None)
        self.mod.__dict__.pop("_bf16_weight", None)


def install_linears(module: torch.nn.Module) -> list:
    """Every bias-free nn.Linear of `module` takes this module's path under CPU bfloat16 autocast. Returns
    handles whose remove() undoes it."""
    handles = []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is None:
            m.forward = _forward.__get__(m)
            handles.append(_Installed(m))
    return handles


def pad_linear_rows(module: torch.nn.Module, multiple: int) -> list:
    """Every nn.Linear of `module` multiplies its input with the token rows (dim -2) padded with zeros to a
    multiple of `multiple`, then drops the padded output rows, through torch's own linear (autocast's casts and
    backward). Returns the hook handles (remove() undoes it)."""
    def pad(mod, args):                 # the forward hook sees the padded input: the true row count rides along
        x = args[0]
        extra = -x.shape[-2] % multiple if x.dim() >= 2 else 0
        mod._rows = x.shape[-2] if extra else None
        return (torch.nn.functional.pad(x, (0, 0, 0, extra)),) if extra else None

    def unpad(mod, args, out):
        return out if mod._rows is None else out[..., :mod._rows, :]

    handles = []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_pre_hook(pad))
            handles.append(m.register_forward_hook(unpad))
    return handles
