"""peagle's native drafter-head format (= vLLM's flat EAGLE-3 layout) and its validation.

A head is an HF-style directory with ``config.json`` and ``model.safetensors``.  Tensor names carry no
``model.`` prefix; layer 0 is the EAGLE-3 layer (attention input 2H = [input_layernorm(embed) ||
hidden_norm(fc(aux))]), layers 1.. are plain Llama layers.  See ``expected_shapes`` for the full list.

vLLM does not check that a drafter's weights are complete (a missing tensor keeps its random init and the
head then accepts nothing), and a wrong aux-layer id or vocabulary silently destroys acceptance.  So every
path that writes or loads a head in peagle goes through :func:`validate_head`, which returns a list of
human-readable problems (empty = valid).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .config import (
    NUM_AUX,
    int_problems,
    is_parallel_head,
    missing_defaults,
    target_text_config,
    validate_config,
)

LAYER0_ONLY = ("hidden_norm.weight",)


class HeadValidationError(ValueError):
    """Raised when a head does not satisfy the format; ``.problems`` lists every problem found."""

    def __init__(self, problems: list[str], what: str = "head"):
        self.problems = list(problems)
        msg = f"{what} is not a valid peagle/vLLM EAGLE-3 head ({len(self.problems)} problem(s)):\n" + "\n".join(
            f"  - {p}" for p in self.problems
        )
        super().__init__(msg)


# ----------------------------------------------------------------------------------------------- helpers
def _shape(t: Any) -> tuple[int, ...] | None:
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return tuple(t.shape)
    if hasattr(t, "shape"):  # numpy, safetensors slices
        s = t.shape
        return tuple(s() if callable(s) else s)
    return tuple(int(x) for x in t)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def expected_shapes(config: Mapping, parallel: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor a valid head must contain, with its exact shape (``mask_hidden`` only for P-EAGLE)."""
    c = {**config, **missing_defaults(config)}
    H, T, nh, nkv, hd = (c[k] for k in ("hidden_size", "target_hidden_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim"))
    I, L, V, Vd = (c[k] for k in ("intermediate_size", "num_hidden_layers", "vocab_size", "draft_vocab_size"))
    if parallel is None:
        parallel = is_parallel_head(config)
    attn_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, NUM_AUX * T),
    }
    for i in range(L):
        inp = 2 * H if i == 0 else H
        p = f"layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (nh * hd, inp)
        out[p + "self_attn.k_proj.weight"] = (nkv * hd, inp)
        out[p + "self_attn.v_proj.weight"] = (nkv * hd, inp)
        out[p + "self_attn.o_proj.weight"] = (H, nh * hd)
        if attn_bias:
            out[p + "self_attn.q_proj.bias"] = (nh * hd,)
            out[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            out[p + "self_attn.v_proj.bias"] = (nkv * hd,)
            out[p + "self_attn.o_proj.bias"] = (H,)
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
        if mlp_bias:
            out[p + "mlp.gate_proj.bias"] = (I,)
            out[p + "mlp.up_proj.bias"] = (I,)
            out[p + "mlp.down_proj.bias"] = (H,)
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if i == 0:
            out[p + "hidden_norm.weight"] = (H,)
    out["norm.weight"] = (H,)
    out["lm_head.weight"] = (Vd, H)
    out["d2t"] = (Vd,)  # may be absent for a full-vocabulary head (identity)
    out["t2d"] = (V,)
    if parallel:
        out["mask_hidden"] = (1, 1, NUM_AUX * T)
    return out


def optional_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """Tensors vLLM accepts but does not need (kept if present)."""
    c = {**config, **missing_defaults(config)}
    H, T = c["hidden_size"], c["target_hidden_size"]
    out = {f"layers.{i}.hidden_norm.weight": (H,) for i in range(1, c["num_hidden_layers"])}
    if config.get("norm_before_fc"):
        out["input_norm.weight"] = (NUM_AUX * T,)
    if config.get("fc_norm"):
        out.update({f"fc_norm.{k}.weight": (T,) for k in range(NUM_AUX)})
    return out


# ---------------------------------------------------------------------------------------------- validate
def validate_head(config: Mapping, tensors: Mapping[str, Any], target_config: Mapping | None = None,
                  parallel: bool | None = None) -> list[str]:
    """Check a head (config dict + {name: tensor or shape}) against the format, and against the target.

    ``parallel=True`` checks the P-EAGLE requirements (mask token ids, ``mask_hidden``, H == T);
    ``None`` infers it from the head (method "peagle", a ptd/pard token id, or a mask_hidden tensor).
    Returns a list of problems; empty means valid.
    """
    cfg = dict(config)
    if parallel is None:
        parallel = is_parallel_head(cfg, tensors)
    problems = validate_config(cfg, target_config, parallel)
    if int_problems(cfg):  # shapes can't be derived
        return problems
    return problems + _tensor_problems(cfg, tensors, parallel)


def _tensor_problems(cfg: dict, tensors: Mapping[str, Any], parallel: bool) -> list[str]:
    problems: list[str] = []
    P = problems.append
    V = cfg["vocab_size"]
    # --- tensors ------------------------------------------------------------------------------------
    exp = expected_shapes(cfg, parallel=parallel)
    opt = optional_shapes(cfg)
    full_vocab = cfg["draft_vocab_size"] == cfg["vocab_size"]
    for name, shp in exp.items():
        if name in ("d2t", "t2d") and full_vocab and name not in tensors:
            continue  # identity mapping (the vLLM export drops it; the importer writes it back)
        if name == "embed_tokens.weight" and name not in tensors:
            continue  # the head shares the target's embedding (vLLM and peagle both use the target's)
        if name not in tensors:
            hint = ""
            if name == "mask_hidden":
                hint = " (P-EAGLE heads need it; vLLM refuses parallel drafting without it)"
            elif name == "embed_tokens.weight":
                hint = " (import with --target to copy the target's embedding)"
            P(f"missing tensor {name} {list(shp)}{hint}")
            continue
        got = _shape(tensors[name])
        if name == "mask_hidden":
            if got is None or _numel(got) != _numel(shp):
                P(f"tensor mask_hidden has shape {list(got or ())}, expected {list(shp)} (numel 3*target_hidden_size)")
        elif got != shp:
            P(f"tensor {name} has shape {list(got or ())}, expected {list(shp)}")
    for name in tensors:
        if name in exp:
            continue
        if name in opt:
            got = _shape(tensors[name])
            if got != opt[name]:
                P(f"tensor {name} has shape {list(got or ())}, expected {list(opt[name])}")
            continue
        if name == "mask_hidden":
            continue  # an EAGLE-3 run simply ignores it (vLLM warns)
        hint = ""
        if name.startswith("model.") or name.startswith("midlayer."):
            hint = " (published-layout name; convert with `peagle import`)"
        P(f"unknown tensor {name} {list(_shape(tensors[name]) or ())}: vLLM refuses unknown names{hint}")

    # --- values of d2t / t2d -------------------------------------------------------------------------
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    Vd = cfg["draft_vocab_size"]
    if isinstance(d2t, torch.Tensor) and _shape(d2t) == (Vd,):
        if d2t.dtype != torch.int64:
            P(f"d2t must be int64 (got {d2t.dtype})")
        tgt = torch.arange(Vd, dtype=torch.int64) + d2t.to(torch.int64)
        oob = ((tgt < 0) | (tgt >= V)).nonzero().flatten()
        if len(oob):
            i = int(oob[0])
            P(f"d2t maps {len(oob)} draft id(s) outside the target vocabulary 0..{V - 1} "
              f"(e.g. draft {i} -> {int(tgt[i])})")
        elif torch.unique(tgt).numel() != Vd:
            P("d2t maps two draft ids to the same target id")
        elif Vd == V and bool((d2t != 0).any()):
            P("full-vocabulary head (draft_vocab_size == vocab_size) with a non-identity d2t: vLLM keeps no "
              "draft->target map for such a head, so the permutation would be lost")
        elif isinstance(t2d, torch.Tensor) and _shape(t2d) == (V,) and t2d.dtype == torch.bool:
            if int(t2d.sum()) != Vd or not bool(t2d[tgt].all()):
                P("t2d is inconsistent with d2t (t2d must be true exactly at the target ids d2t maps to)")
    if isinstance(t2d, torch.Tensor) and t2d.dtype != torch.bool:
        P(f"t2d must be bool (got {t2d.dtype})")
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and name not in ("d2t", "t2d") and not t.dtype.is_floating_point:
            P(f"tensor {name} must be floating point (got {t.dtype})")
    return problems


def portability_notes(config: Mapping, target_config: Mapping | None = None) -> list[str]:
    """Valid but version-dependent choices (warnings, not errors)."""
    notes = []
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(aux, list) and target_config is not None:
        L = target_text_config(target_config).get("num_hidden_layers")
        edge = [a for a in aux if a == 0 or a == L]
        if edge:
            notes.append(f"aux id(s) {edge} (embedding output / last layer output) load in vLLM 0.32+, which "
                         "captures ids 0..L; older releases capture inside the layer loop (ids 1..L-1 only)")
    return notes

