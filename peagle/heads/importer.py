"""Import drafter heads published in vLLM's flat EAGLE-3 layout or in the "speculators" layout into
peagle's native layout (see :mod:`peagle.heads.format`), with the same validation as export.

Conversions:
- speculators config (``speculators_model_type`` + ``transformer_layer_config``) -> flat config;
  ``mask_token_id`` -> ``ptd_token_id``/``pard_token``; K (``proposal_methods``) -> ``peagle.train_depths``;
- ``model.`` prefixes stripped, ``midlayer.*`` -> ``layers.0.*``;
- full-vocabulary head without ``d2t`` -> identity ``d2t`` (zeros) + all-true ``t2d``; ``t2d`` rebuilt from ``d2t``;
- missing ``embed_tokens`` (or ``lm_head`` of a full-vocabulary head) copied from the target when given,
  as vLLM shares them in that case;
- aux layer ids nested in ``eagle_config`` moved to top level; missing ones get vLLM's target default
  (2, L//2, L-3) when the target is given;
- ``max_position_embeddings`` raised to the target's.
"""
from __future__ import annotations

import copy
import os
from typing import Mapping

import torch

from ..models.files import iter_safetensors, read_config, safetensors_files
from .config import (
    NATIVE_ARCH,
    fit_context,
    is_parallel_head,
    missing_defaults,
    target_text_config,
    vllm_aux_layer_ids,
)
from .format import HeadValidationError, validate_head
from .io import check_head_out, check_head_src, load_head_dir, replace_head_dir

# keys of a speculators config that are not Llama-layer fields but belong in the flat config
_SPEC_TOP_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
                  "norm_before_fc", "fc_norm", "norm_output", "num_aux_hidden_states", "embed_requires_grad")
_DROP_KEYS = ("speculators_model_type", "speculators_config", "transformer_layer_config", "speculators_version",
              "has_no_defaults_at_init", "auto_map", "_name_or_path", "transformers_version", "torch_dtype")


def is_speculators_config(config: Mapping) -> bool:
    return "speculators_model_type" in config or "transformer_layer_config" in config


def _first_k(spec_cfg: Mapping | None) -> int | None:
    if not isinstance(spec_cfg, Mapping):
        return None
    for pm in spec_cfg.get("proposal_methods") or []:
        if isinstance(pm, Mapping) and pm.get("speculative_tokens"):
            return int(pm["speculative_tokens"])
    return None


def convert_config(config: Mapping, notes: list[str] | None = None) -> dict:
    """Flat (native) config from a flat or speculators config. Does not need the tensors or the target."""
    notes = notes if notes is not None else []
    src = copy.deepcopy(dict(config))
    peagle_block = dict(src.get("peagle") or {})
    if is_speculators_config(src):
        smt = src.get("speculators_model_type")
        layer = dict(src.get("transformer_layer_config") or {})
        flat = {k: v for k, v in layer.items() if k not in _DROP_KEYS}
        for k in _SPEC_TOP_KEYS:
            if k in src:
                flat[k] = src[k]
        if "norm_before_residual" not in src:
            # vLLM's speculators updaters: eagle3 defaults to True, peagle to False
            flat["norm_before_residual"] = smt == "eagle3"
            notes.append(f"norm_before_residual absent in the speculators config; using vLLM's default for "
                         f"{smt!r}: {flat['norm_before_residual']}")
        mt = src.get("mask_token_id")
        if mt is not None:
            flat["ptd_token_id"] = flat["pard_token"] = int(mt)
        spec_cfg = src.get("speculators_config") or {}
        k = _first_k(spec_cfg)
        peagle_block.setdefault("method", "peagle" if smt == "peagle" or mt is not None else "eagle3")
        if k:                          # the K it is served with; a trained depth only where none is recorded
            peagle_block.setdefault("num_speculative_tokens", k)
            if peagle_block["method"] == "peagle" and "train_depths" not in peagle_block:
                peagle_block["train_depths"] = k
        ver = spec_cfg.get("verifier") if isinstance(spec_cfg, Mapping) else None
        if isinstance(ver, Mapping) and ver.get("name_or_path"):
            peagle_block.setdefault("target", ver["name_or_path"])
        peagle_block["imported_from"] = f"speculators:{smt}"
    else:
        flat = {k: v for k, v in src.items() if k not in ("_name_or_path", "transformers_version")}
        if peagle_block.get("imported_from") is None and flat.get("architectures") != [NATIVE_ARCH]:
            peagle_block["imported_from"] = f"flat:{(flat.get('architectures') or ['?'])[0]}"
        # mask token: ptd_token_id / pard_token (peagle's keys) win; otherwise take vLLM's other keys.
        # A conflicting mask_token_id is dropped (vLLM >= 0.22 would prefer it, 0.16-0.19 ignore it).
        mt = flat.pop("mask_token_id", None)
        if mt is None and isinstance(flat.get("dflash_config"), Mapping):
            mt = flat["dflash_config"].get("mask_token_id")
        ptd, pard = flat.get("ptd_token_id"), flat.get("pard_token")
        tok = ptd if ptd is not None else pard if pard is not None else mt
        if ptd is not None and pard is not None and ptd != pard:
            tok = pard  # vLLM 0.16-0.19 and >= 0.22 both read pard_token before ptd_token_id
            notes.append(f"ptd_token_id={ptd} != pard_token={pard}; using {pard} (what vLLM reads) for both")
        if mt is not None and tok is not None and mt != tok:
            notes.append(f"dropped conflicting mask_token_id={mt} (mask token is {tok})")
        if tok is not None:
            flat["ptd_token_id"] = flat["pard_token"] = int(tok)
    dc = flat.get("dflash_config")
    if isinstance(dc, Mapping) and "mask_token_id" in dc:   # vLLM reads it before pard_token / ptd_token_id
        rest = {k: v for k, v in dc.items() if k != "mask_token_id"}
        if rest:
            flat["dflash_config"] = rest
        else:
            del flat["dflash_config"]
    arch = (flat.get("architectures") or [None])[0]
    if arch != NATIVE_ARCH:
        if arch not in (None, "Eagle3LlamaForCausalLM", "LlamaForCausalLM", "LlamaForCausalLMEagle3"):
            notes.append(f"architectures {arch!r} rewritten to {NATIVE_ARCH!r}")
        flat["architectures"] = [NATIVE_ARCH]
    flat["model_type"] = "llama"
    ec = dict(flat.get("eagle_config") or {})
    if flat.get("eagle_aux_hidden_state_layer_ids") is None and ec.get("eagle_aux_hidden_state_layer_ids") is not None:
        flat["eagle_aux_hidden_state_layer_ids"] = list(ec["eagle_aux_hidden_state_layer_ids"])
        notes.append("eagle_aux_hidden_state_layer_ids moved from eagle_config to top level")
    ec.pop("eagle_aux_hidden_state_layer_ids", None)
    ec["use_aux_hidden_state"] = True
    flat["eagle_config"] = ec
    if flat.get("tie_word_embeddings"):
        notes.append("tie_word_embeddings set to false")
    flat["tie_word_embeddings"] = False
    filled = missing_defaults(flat)
    if "rope_theta" in filled and "rope_theta" not in flat:
        notes.append("rope_theta absent; wrote 10000.0 (the value vLLM would use)")
    flat.update(filled)
    if "method" not in peagle_block:
        peagle_block["method"] = "peagle" if flat.get("ptd_token_id") is not None else "eagle3"
    flat["peagle"] = peagle_block
    return flat


def convert_tensor_names(tensors: Mapping[str, torch.Tensor], notes: list[str] | None = None) -> dict[str, torch.Tensor]:
    notes = notes if notes is not None else []
    out: dict[str, torch.Tensor] = {}
    renamed = 0
    for name, t in tensors.items():
        new = name
        while new.startswith("model."):
            new = new[len("model."):]
        if new.startswith("midlayer."):
            new = "layers.0." + new[len("midlayer."):]
        if new != name:
            renamed += 1
        if new in out:
            raise HeadValidationError([f"tensor names {name!r} and another both map to {new!r}"], "import")
        out[new] = t
    if renamed:
        notes.append(f"renamed {renamed} tensor(s) (model. prefix / midlayer. -> layers.0.)")
    return out


def _target_tensor(target_dir: str | os.PathLike, suffix: str) -> torch.Tensor | None:
    """Find e.g. the target's embed_tokens.weight regardless of prefix (model., model.language_model., ...)."""
    found = iter_safetensors(safetensors_files(target_dir), lambda k: k == suffix or k.endswith("." + suffix))
    return next((t for _, t in found), None)


def convert_head(config: Mapping, tensors: Mapping[str, torch.Tensor], target_dir: str | os.PathLike | None = None,
                 target_config: Mapping | None = None, notes: list[str] | None = None
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Native (config, tensors) from a head in either published layout. Does not validate."""
    notes = notes if notes is not None else []
    if target_config is None and target_dir is not None:
        target_config = read_config(target_dir)
    cfg = convert_config(config, notes)
    ts = convert_tensor_names(tensors, notes)
    tc = target_text_config(target_config) if target_config is not None else None

    if tc is not None:
        if cfg.get("eagle_aux_hidden_state_layer_ids") is None:
            cfg["eagle_aux_hidden_state_layer_ids"] = vllm_aux_layer_ids(tc["num_hidden_layers"])
            notes.append(f"eagle_aux_hidden_state_layer_ids absent; wrote vLLM's target default "
                         f"{cfg['eagle_aux_hidden_state_layer_ids']}")
        fit_context(cfg, tc, notes)

    V, Vd = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    # shared tensors (vLLM uses the target's when the head does not ship them)
    if "embed_tokens.weight" not in ts and target_dir is not None:
        emb = _target_tensor(target_dir, "embed_tokens.weight")
        if emb is not None:
            ts["embed_tokens.weight"] = emb
            notes.append("embed_tokens.weight copied from the target (vLLM would share the target's)")
    if "lm_head.weight" not in ts and target_dir is not None and V is not None and Vd == V:
        lm = _target_tensor(target_dir, "lm_head.weight")
        if lm is None and tc is not None and tc.get("tie_word_embeddings", True):
            lm = _target_tensor(target_dir, "embed_tokens.weight")
        if lm is not None:
            ts["lm_head.weight"] = lm
            notes.append("lm_head.weight copied from the target (vLLM would share the target's)")
    # vocab mapping
    if "d2t" not in ts and V is not None and Vd == V:
        ts["d2t"] = torch.zeros(V, dtype=torch.int64)
        notes.append("full-vocabulary head without d2t: wrote identity d2t (zeros)")
    if "d2t" in ts:
        if ts["d2t"].is_floating_point():
            raise HeadValidationError([f"d2t is stored as {str(ts['d2t'].dtype).replace('torch.', '')}: token "
                                       "offsets must be integers (a float dtype may have rounded them)"], "import")
        ts["d2t"] = ts["d2t"].to(torch.int64)
        if "t2d" not in ts and V is not None:
            d2t = ts["d2t"]
            tgt = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
            t2d = torch.zeros(V, dtype=torch.bool)
            if len(tgt) and int(tgt.min()) >= 0 and int(tgt.max()) < V:
                t2d[tgt] = True
                ts["t2d"] = t2d
                notes.append("t2d rebuilt from d2t")
    if "t2d" in ts:
        ts["t2d"] = ts["t2d"].to(torch.bool)
    # mask_hidden: any shape with numel 3T -> [1, 1, 3T]
    if "mask_hidden" in ts:
        mh = ts["mask_hidden"]
        ts["mask_hidden"] = mh.reshape(1, 1, -1)
        if cfg.get("ptd_token_id") is None:
            notes.append("head ships mask_hidden but no mask-token id: it is a P-EAGLE head missing "
                         "ptd_token_id/pard_token")
    return cfg, ts


def import_head(src: str | os.PathLike, out: str | os.PathLike | None = None,
                target_dir: str | os.PathLike | None = None, validate: bool = True,
                notes: list[str] | None = None, overwrite: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """Load a published head (flat or speculators layout) as a validated native head; write it to ``out`` (new,
    empty, or with ``overwrite`` a head's directory other than ``src``: io.check_head_out)."""
    notes = notes if notes is not None else []
    check_head_src(src)
    if out is not None:
        check_head_out(out, overwrite, src=src)
    config, tensors = load_head_dir(src)
    tcfg = read_config(target_dir) if target_dir is not None else None
    cfg, ts = convert_head(config, tensors, target_dir=target_dir, target_config=tcfg, notes=notes)
    if validate:
        problems = validate_head(cfg, ts, tcfg, parallel=is_parallel_head(cfg, ts))
        if problems:
            raise HeadValidationError(problems, f"imported head {src}")
    if out is not None:
        replace_head_dir(out, cfg, ts, overwrite=overwrite)
    return cfg, ts
