"""The drafter heads' linears in bfloat16 training on a CPU (the Trainer installs them under bfloat16 autocast).

Invariant: an installed nn.Linear (no bias) computes what ``F.linear`` computes under bfloat16 autocast -- the
output ``bf16(x) @ bf16(W)^T``, and the gradients of x and W of those bfloat16 products, W's rounded to bfloat16
as autocast's cast backward leaves it -- up to the order of the products' sums, which the tests hold to the
autocast reference with negative controls. Outside autocast it is ``F.linear``.

Why (measured in docs/training-study/train-cost.md), on a CPU:
- oneDNN builds a bfloat16 product's kernel per new shape (~4 ms for [900 x 576] x [576 x 1536] against 1.6 ms
  to run it), so token rows are padded with zeros to a multiple of ``PAD_ROWS`` and a run sees a few shapes;
- its bfloat16 products run 2-3x slower with a transposed left operand, the form of a weight gradient g^T x:
  that is computed from a row-major copy of g^T, or as (x^T g)^T when x^T and the transposed result are the
  smaller copies (the LM head), written by the extension's transposing pass (peagle/csrc/transpose_avx512.cpp;
  torch's copy elsewhere);
- autocast casts every weight again in each autocast region: here once per weight version;
- one product of a wider weight costs less than several narrow ones of one input: q/k/v and gate/up run as one
  (their module's ``project``).
``pad_linear_rows`` is the padding alone around torch's own linear (the previous path, kept for A/B runs)."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

PAD_ROWS = 64     # token rows of every head product padded to a multiple of this
BF16 = torch.bfloat16


def _transpose(x: torch.Tensor, rows_pad: int, to_float32: bool = False) -> torch.Tensor:
    """x [R, C] (contiguous) -> [C, rows_pad] in bfloat16 (or float32), zero from column R."""
    from ..models import quant_ext
    ext = quant_ext.avx512()
    R, C = x.shape
    if ext is not None and C % 16 == 0 and rows_pad % 16 == 0:
        return ext.transpose_pad(x, rows_pad, to_float32)
    out = torch.zeros(C, rows_pad, dtype=torch.float32 if to_float32 else BF16, device=x.device)
    out[:, :R] = x.t()
    return out


def _weight_bf16(mods: tuple) -> torch.Tensor:
    """The weights of mods stacked [sum out, in] in bfloat16, cast again only when one of them changed (its
    version counter moved); cached on the first module, one entry per group size."""
    key = tuple((m.weight._version, m.weight.data_ptr()) for m in mods)
    cache = mods[0].__dict__.setdefault("_bf16_weights", {})
    hit = cache.get(len(mods))
    if hit is None or hit[0] != key:
        w = torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()
        cache[len(mods)] = (key, w.to(BF16))
    return cache[len(mods)][1]


class _Linear(torch.autograd.Function):
    """x [.., in] (any float dtype), the weights [out_i, in] float32 of mods -> bf16 [.., sum out_i]; see the
    module docstring."""

    @staticmethod
    def forward(ctx, x, mods, *weights):
        n_in = x.shape[-1]
        x2 = x.reshape(-1, n_in)
        n = x2.shape[0]
        pad = -(-n // PAD_ROWS) * PAD_ROWS
        xb = torch.empty(pad, n_in, dtype=BF16, device=x.device)   # [pad, in]: x's rows, then zeros
        xb[:n].copy_(x2)
        xb[n:].zero_()
        wb = _weight_bf16(mods)                                    # [out, in]
        y = torch.mm(xb, wb.t())[:n]                               # [n, out]
        ctx.save_for_backward(xb, wb)
        ctx.n, ctx.x_shape, ctx.x_dtype = n, x.shape, x.dtype
        ctx.outs = [w.shape[0] for w in weights]
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
        if any(ctx.needs_input_grad[2:]):
            if pad * n_out <= pad * n_in + n_in * n_out:     # g^T [out, pad] is the smaller copy
                gw = torch.mm(_transpose(gp, pad), xb).float()                   # [out, in]
            else:                                            # x^T [in, pad] and the [in, out] result
                gw = _transpose(torch.mm(_transpose(xb, pad), gp), n_in, True)   # [out, in]
        return (gx, None) + (gw.split(ctx.outs) if gw is not None else (None,) * len(ctx.outs))


def bf16_autocast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16


def _product(x: torch.Tensor, mods: tuple) -> torch.Tensor:
    """x [.., in] times the stacked weights of mods -> bf16 [.., sum out] (_Linear, autocast off inside)."""
    with torch.autocast("cpu", enabled=False):
        return _Linear.apply(x, mods, *(m.weight for m in mods))


def _forward(mod: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _product(x, (mod,)) if bf16_autocast(x) else F.linear(x, mod.weight)


def _grouped(owner, mods: tuple, x: torch.Tensor) -> tuple:
    """owner.project(x): the outputs of mods (bias-free linears of one input) from one product."""
    if not bf16_autocast(x):
        return type(owner).project(owner, x)
    return _product(x, mods).split([m.weight.shape[0] for m in mods], -1)


# a module's project(x) that returns these linears' outputs of one input runs them as one product
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Installed:
    """Undoes an install on one module: remove() drops the attributes `keys` the install set (as torch's hooks'
    handles do)."""

    def __init__(self, mod, keys):
        self.mod, self.keys = mod, keys

    def remove(self):
        for k in self.keys:
            self.mod.__dict__.pop(k, None)


def install_linears(module: torch.nn.Module) -> list:
    """Every bias-free nn.Linear of `module` takes this module's path under CPU bfloat16 autocast, and a module
    whose project(x) returns one of GROUPS' outputs runs them as one product. Returns handles whose remove()
    undoes it."""
    handles = []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is None:
            m.forward = partial(_forward, m)
            handles.append(Installed(m, ("forward", "_bf16_weights")))
        for names in GROUPS:
            mods = tuple(getattr(m, k, None) for k in names)
            if callable(getattr(m, "project", None)) and all(
                    isinstance(L, torch.nn.Linear) and L.bias is None and L.in_features == mods[0].in_features
                    for L in mods):
                m.project = partial(_grouped, m, mods)
                handles.append(Installed(m, ("project",)))
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
