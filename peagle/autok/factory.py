"""The K policy a speculative config asks for, and what it needs: the largest K, the head's training accuracy
(the acceptance prior) and the cost model (loaded from the cache directory, or measured once and saved).

- `"num_speculative_tokens": K` -> FixedK(K)
- `"num_speculative_tokens": K` + `"num_speculative_tokens_per_batch_size"` -> BatchSizeSchedule (vLLM's)
- `"num_speculative_tokens": "auto"` -> AutoK, K in 0..`max_num_speculative_tokens` (default: the depth the head
  was trained for), its knobs from the speculative config's "auto_k" (AutoKConfig), the environment's A/B
  overrides applied ($PEAGLE_AUTOK_GUARD, _MARGIN, _PROBE, _TRACE: AutoKConfig.with_env); with token trees
  ("eagle_topk" / "num_draft_tokens") it picks tree, chain or plain per step (treechoice.py)"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from ..kpolicy import BatchSizeSchedule, FixedK, KPolicy
from ..models import quant_ext
from .acceptance import Acceptance
from .auto import AutoK
from .config import AutoKConfig
from .costmodel import CostModel, cache_dir, cache_key
from .measure import grid_batch_sizes, measure
from .treechoice import TreeChoice

DEFAULT_K_MAX = 7            # a head that records no training depth
CTX_LEN, STEPS, SMALL_PASSES = 64, 2, 8       # measurement settings (part of the cache key)


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def trained_depth(head_cfg: dict) -> int | None:
    """The K the head was trained for: P-EAGLE's parallel depths, EAGLE-3's test-time-training unroll, or the
    K it was exported / imported with."""
    pb = head_cfg.get("peagle") or {}
    for key in ("train_depths", "ttt_steps", "num_speculative_tokens"):
        v = pb.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


def training_accuracy(head_cfg: dict) -> list | None:
    acc = (head_cfg.get("peagle") or {}).get("final_acc")
    return [float(x) for x in acc] if isinstance(acc, list) and acc else None


def auto_k_max(head_cfg: dict, bound: int | None = None) -> int:
    """The largest K "auto" may use: the bound if given, else the head's trained depth."""
    return bound or trained_depth(head_cfg) or DEFAULT_K_MAX


def k_max_for(spec, head_cfg: dict) -> int:
    return auto_k_max(head_cfg, spec.max_num_speculative_tokens) if spec.auto else spec.num_speculative_tokens


def cost_settings(target) -> dict:
    """What decides a target's step costs beyond its files and the machine (part of the cost cache's key)."""
    settings = {"ctx_len": CTX_LEN, "steps": STEPS, "small_passes": SMALL_PASSES, "device": str(target.device)}
    if getattr(target, "backend", "native") != "native":       # the transformers backend's steps cost more
        settings["backend"] = target.backend
    if getattr(target, "quantization", "none") != "none":      # q8 / q4 weights: another step cost
        settings["quantization"] = target.quantization
    if str(target.device) == "cpu":     # the C++ kernels (or torch's products) and which of their paths run
        settings["kernels"] = quant_ext.describe() if quant_ext.get() is not None else "torch"
        settings["f32_kernel"] = bool(getattr(target, "f32_kernel", False))
    return settings


def cost_model_for(target, make_engine, method: str, k_max: int, max_batch: int, model_dir: str, head_dir: str,
                   dtype, log=_log, refresh: bool = False) -> CostModel:
    """The cached cost model of this machine/model/head if it covers k_max and max_batch; else (or with
    refresh) measured now (once: tens of seconds on a CPU for a small model) and saved. make_engine: as
    peagle.autok.measure.measure takes it."""
    name, ident = cache_key(model_dir, head_dir, method, dtype, cost_settings(target))
    path = os.path.join(cache_dir(), name)
    cm = None if refresh else CostModel.load(path)
    if cm is None or not cm.covers(k_max, max_batch):
        bs = grid_batch_sizes(max_batch)
        if log:
            log(f"autok: measuring step costs for {method}, K 0..{k_max} x batch sizes {bs} (once per "
                f"machine/model/head; saved to {path})")
        cm = measure(target, make_engine, k_max, bs, CTX_LEN, STEPS, log=log, small_passes=SMALL_PASSES)
        cm.meta["identity"] = ident
        cm.save(path)
    cm.meta["path"] = path
    return cm


def auto_policy(cost: CostModel, head_cfg: dict, k_max: int, config: AutoKConfig | None = None,
                tree_cost: CostModel | None = None) -> AutoK:
    """A fresh AutoK (its own copy of the cost model to refine, acceptance from the head's prior) with config
    (the defaults if None) and the environment's A/B overrides on top. tree_cost: the cost model of the
    engine's token-tree steps (then each step picks tree, chain or plain: treechoice.py); None: no choice."""
    cfg = (config or AutoKConfig()).with_env()
    prior = training_accuracy(head_cfg)
    tree = None if tree_cost is None else TreeChoice(tree_cost.copy(), Acceptance(k_max, prior=prior))
    return AutoK(k_max, cost.copy(), Acceptance(k_max, prior=prior), cfg, tree=tree)


def chain_of(spec):
    """The same speculative config without token trees (its chain steps)."""
    return replace(spec, eagle_topk=1, num_draft_tokens=None)


def make_policy(spec, target, head, engines, k_max: int, max_num_seqs: int, model_dir: str, dtype,
                log=_log) -> KPolicy:
    """engines(spec) -> make_engine for the measurement (peagle/llm.py measuring_engines). With "auto" and
    token trees, chain and tree steps are measured (and cached) apart, and each step picks one of them."""
    if spec.auto:
        cfg = AutoKConfig.from_dict(spec.auto_k)       # checked before the cost model is measured
        chain = chain_of(spec)
        cm = cost_model_for(target, engines(chain), chain.name, k_max, max_num_seqs, model_dir, spec.model, dtype, log)
        tree_cm = None
        if spec.cost_name != chain.name:
            tree_cm = cost_model_for(target, engines(spec), spec.cost_name, k_max, max_num_seqs, model_dir,
                                     spec.model, dtype, log)
        return auto_policy(cm, head.cfg, k_max, cfg, tree_cost=tree_cm)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return BatchSizeSchedule(spec.num_speculative_tokens_per_batch_size, k_max)
    return FixedK(k_max)
