"""Export a peagle head for serving in vLLM.

``--format vllm`` (default) writes vLLM's flat EAGLE-3 layout, loaded by vLLM >= 0.16 with
``{"method": "eagle3", "model": OUT, "num_speculative_tokens": K, "parallel_drafting": true}``.
``--format speculators`` writes the speculators layout (``speculators_model_type`` "peagle" / "eagle3"), which
vLLM >= 0.22 also serves directly as ``vllm serve OUT`` (the verifier is taken from the config).

The head is validated before anything is written: vLLM silently keeps random weights for a missing tensor
(and then accepts nothing), so peagle refuses to write such a head.  No tokenizer is copied (vLLM uses the
target's).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Mapping

from ..spec_config import MAX_K, is_k
from .config import NUM_AUX, fit_context, is_parallel_head
from .format import HeadValidationError, portability_notes, validate_head
from .importer import convert_head
from .io import check_head_out, check_head_src, load_head_dir, read_config, replace_head_dir

FORMATS = ("vllm", "speculators")
# flat-config keys that describe the head rather than its transformer layer (speculators top level)
_SPEC_TOP = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual")
_SPEC_DROP = ("architectures", "eagle_config", "ptd_token_id", "pard_token", "mask_token_id", "peagle",
              "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path")


def normalise_for_vllm(config: Mapping, target_config: Mapping | None, notes: list[str]) -> dict:
    cfg = copy.deepcopy(dict(config))
    if target_config is not None:
        fit_context(cfg, target_config, notes)
    mt = cfg.pop("mask_token_id", None)
    if mt is not None:
        notes.append(f"dropped mask_token_id={mt} (vLLM >= 0.22 would prefer it over ptd_token_id/pard_token)")
    cfg.setdefault("eagle_config", {"use_aux_hidden_state": True})
    cfg["tie_word_embeddings"] = False
    return cfg


def _verifier(target_dir, target_config: Mapping | None, cfg: Mapping) -> dict:
    if target_dir is not None:
        name = str(Path(target_dir).resolve())
    else:
        name = (cfg.get("peagle") or {}).get("target")
    archs = (target_config or {}).get("architectures") or ["LlamaForCausalLM"]
    return {"name_or_path": name, "architectures": list(archs)}


def speculators_config(cfg: Mapping, parallel: bool, k: int, verifier: Mapping) -> dict:
    """The speculators-layout config.json for a validated flat config."""
    smt = "peagle" if parallel else "eagle3"
    layer = {key: v for key, v in cfg.items() if key not in _SPEC_TOP and key not in _SPEC_DROP}
    layer["model_type"] = "llama"
    layer["architectures"] = ["LlamaForCausalLM"]
    out: dict = {
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
        "speculators_model_type": smt,
        "speculators_version": "0.3.0",
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(cfg["eagle_aux_hidden_state_layer_ids"]),
        # written explicitly: vLLM's speculators eagle3 updater defaults it to True, the flat layout to False
        "norm_before_residual": bool(cfg["norm_before_residual"]),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": smt,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "verifier": dict(verifier),
        },
        "peagle": dict(cfg.get("peagle") or {}),
    }
    if parallel:
        out["mask_token_id"] = cfg["ptd_token_id"]
    return out


def export_head(head_dir, out_dir, format: str = "vllm", target_dir=None, num_speculative_tokens: int | None = None,
                notes: list[str] | None = None, overwrite: bool = False) -> dict:
    """Validate ``head_dir`` (peagle native layout; published layouts are converted first) and write it to
    ``out_dir`` in vLLM's flat layout or the speculators layout. Returns the written config.
    An existing head in ``out_dir`` is replaced only with ``overwrite`` (never ``head_dir`` itself, nor a model's
    directory). Raises :class:`HeadValidationError` (nothing written) if the head is invalid, ValueError for a
    ``num_speculative_tokens`` outside 1..MAX_K."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} (got {format!r})")
    k = num_speculative_tokens
    if k is not None and not is_k(k):
        raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_K} (got {k!r})")
    notes = notes if notes is not None else []
    check_head_src(head_dir)
    check_head_out(out_dir, overwrite, src=head_dir)   # before any work: a model's directory is never replaced
    config, tensors = load_head_dir(head_dir)
    tcfg = read_config(target_dir) if target_dir is not None else None
    parallel = is_parallel_head(config, tensors)
    # published layouts (midlayer.*, model. prefixes, speculators config) are normalised first; a native head
    # passes through unchanged.  No tensor is invented here (no target-embedding copy): use `peagle import`.
    cfg, ts = convert_head(config, tensors, target_dir=None, target_config=None, notes=notes)
    if parallel and cfg.get("peagle", {}).get("method") != "peagle":
        cfg["peagle"]["method"] = "peagle"
    cfg = normalise_for_vllm(cfg, tcfg, notes)
    problems = validate_head(cfg, ts, tcfg, parallel=parallel)
    notes.extend(portability_notes(cfg, tcfg))
    if k is None:
        pb = cfg.get("peagle") or {}
        k = pb.get("serve_k") or pb.get("num_speculative_tokens") or pb.get("train_depths") or pb.get("ttt_steps") or 3
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            problems.append(f"the K it records (peagle block) must be a positive integer (got {k!r}); pass -k")
        elif k > MAX_K:
            notes.append(f"K {k} (the head's depth) capped at {MAX_K}, peagle's and its spec config's limit")
            k = MAX_K
    if format == "speculators" and target_dir is None and not (cfg.get("peagle") or {}).get("target"):
        problems.append("the speculators layout names its verifier: pass --target DIR")
    if problems:
        raise HeadValidationError(problems, f"head {head_dir}")

    ts = dict(ts)
    if "mask_hidden" in ts:
        ts["mask_hidden"] = ts["mask_hidden"].reshape(1, 1, NUM_AUX * cfg["target_hidden_size"])
    if not parallel and "mask_hidden" in ts:
        notes.append("dropped mask_hidden (not a parallel-drafting head)")
        ts.pop("mask_hidden")
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:
        # vLLM has no draft->target map for a full-vocabulary head and refuses a d2t tensor ("no module or
        # parameter named 'draft_id_to_target_id'"); validation guarantees d2t is the identity here.
        dropped = [n for n in ("d2t", "t2d") if ts.pop(n, None) is not None]
        if dropped:
            notes.append(f"dropped {' and '.join(dropped)} (full-vocabulary head: identity mapping, vLLM refuses d2t)")
    cfg.setdefault("peagle", {})["num_speculative_tokens"] = int(k)
    if format == "vllm":
        out_cfg = cfg
    else:
        out_cfg = speculators_config(cfg, parallel, k, _verifier(target_dir, tcfg, cfg))

    replace_head_dir(out_dir, out_cfg, ts, overwrite=overwrite)
    return out_cfg
