"""vLLM's --speculative-config JSON: parsed and checked with the same keys and meaning, plus choosing K:
`"num_speculative_tokens": "auto"` (peagle: K per step, see peagle.autok), optionally bounded by
`"max_num_speculative_tokens"`, and vLLM's explicit `"num_speculative_tokens_per_batch_size"` schedule
(with an integer num_speculative_tokens, the largest K, as in vLLM), with `"auto_k"` for auto K's knobs
(peagle: peagle/autok/config.py); and how sampled rows draft (peagle):
`"draft_sampling": "sample"` (the default: drafts drawn from the drafter's distribution q, verified with
min(1, p/q) and the (p - q)+ residual; peagle/drafters/base.py, peagle/verify.py) or `"argmax"` (argmax drafts
verified as one-hot drafts: vLLM's behaviour and its acceptance counts at temperature > 0). Both are lossless;
greedy rows (temperature 0) draft and verify the same in both. The key is peagle's: `as_dict()` leaves the
default out, and `peagle tune` never writes it (vLLM has no such key).
Token trees (peagle, named like SGLang's flags; peagle/tree.py): `"eagle_topk"` (children per tree node; 1, the
default, is today's chain) and `"num_draft_tokens"` (draft nodes the target verifies per step, <= 64; default
eagle_topk x K). With both unset a step is exactly today's chain. vLLM <= 0.32 has no tree speculation: `peagle
export` and `peagle tune` never pass these keys on."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import PeagleError
from .kpolicy import validate_schedule

KNOWN = {"method", "model", "num_speculative_tokens", "parallel_drafting", "draft_tensor_parallel_size", "auto_k",
         "max_model_len", "disable_padded_drafter_batch", "num_speculative_tokens_per_batch_size",
         "max_num_speculative_tokens", "draft_sampling", "eagle_topk", "num_draft_tokens"}
TREE_KEYS = ("eagle_topk", "num_draft_tokens")      # peagle's: never in a config written for vLLM
AUTO = "auto"
DRAFT_SAMPLING = ("argmax", "sample")
# drafts sampled from q accepted more in 14 of 16 measured T > 0 cells (docs/benchmarks/sampling.md); greedy
# rows draft and verify the same in both modes, so vLLM's greedy acceptance counts are unchanged
DEFAULT_DRAFT_SAMPLING = "sample"


def speculative_config(head, k, parallel: bool) -> dict:
    """vLLM's speculative config for a head in the EAGLE-3 layout (P-EAGLE: parallel_drafting); k: an int or
    "auto" (peagle only)."""
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k if k == AUTO else int(k),
            "parallel_drafting": bool(parallel)}


@dataclass
class SpecConfig:
    method: str
    model: str
    num_speculative_tokens: int | str            # an int, or "auto"
    parallel_drafting: bool = False
    max_num_speculative_tokens: int | None = None
    num_speculative_tokens_per_batch_size: list | None = None
    # auto K's knobs as given (peagle only, with "auto"; typed and checked by AutoKConfig.from_dict when the
    # policy is built: peagle/autok/config.py; `peagle tune` never passes them on); keyword-only
    auto_k: dict | None = field(default=None, kw_only=True)
    draft_sampling: str = DEFAULT_DRAFT_SAMPLING  # "argmax" | "sample" (peagle only)
    eagle_topk: int = 1                            # token trees (peagle only): children per node
    num_draft_tokens: int | None = None            # tree nodes verified per step (None: eagle_topk x K)

    def tree(self, k: int):
        """The TreeSpec of this config for K up to k, or None (a chain: both tree keys unset / eagle_topk 1)."""
        from .tree import MAX_NODES, TreeSpec
        if self.eagle_topk == 1 and self.num_draft_tokens is None:
            return None
        return TreeSpec(self.eagle_topk, self.num_draft_tokens or min(MAX_NODES, self.eagle_topk * k))

    @property
    def name(self) -> str:
        return "peagle" if self.parallel_drafting else "eagle3"

    @property
    def cost_name(self) -> str:
        """The name auto K's cached cost model is kept under: a token-tree config's steps cost what its trees
        cost, so they are measured and cached apart from the chain's ("peagle-tree4x8")."""
        if self.eagle_topk == 1 and self.num_draft_tokens is None:
            return self.name
        return f"{self.name}-tree{self.eagle_topk}x{self.num_draft_tokens or 'k'}"

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def k_label(self) -> str:
        if self.auto:
            return "auto" + (f"<={self.max_num_speculative_tokens}" if self.max_num_speculative_tokens else "")
        if self.num_speculative_tokens_per_batch_size:
            return f"per-batch-size<={self.num_speculative_tokens}"
        return str(self.num_speculative_tokens)

    def as_dict(self) -> dict:
        d = speculative_config(self.model, self.num_speculative_tokens, self.parallel_drafting)
        if self.max_num_speculative_tokens is not None:
            d["max_num_speculative_tokens"] = self.max_num_speculative_tokens
        if self.num_speculative_tokens_per_batch_size is not None:
            d["num_speculative_tokens_per_batch_size"] = [list(e) for e in self.num_speculative_tokens_per_batch_size]
        if self.auto_k is not None:
            d["auto_k"] = dict(self.auto_k)
        if self.draft_sampling != DEFAULT_DRAFT_SAMPLING:    # the default stays out: the dict vLLM gets is vLLM's
            d["draft_sampling"] = self.draft_sampling
        if self.eagle_topk != 1:
            d["eagle_topk"] = self.eagle_topk
        if self.num_draft_tokens is not None:
            d["num_draft_tokens"] = self.num_draft_tokens
        return d


MAX_K = 32                                 # the largest K peagle drafts (num_speculative_tokens is 1..MAX_K)


def is_k(v) -> bool:
    """v is a static K: an integer in 1..MAX_K (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_K


OFF = ("", "none", "null", "off")          # a speculative config that turns speculation off (as `peagle serve` takes)


def parse_spec_config(spec) -> SpecConfig | None:
    if spec is None or spec == {} or isinstance(spec, str) and spec.strip().lower() in OFF:
        return None
    if isinstance(spec, SpecConfig):
        return spec
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise PeagleError(f"speculative config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise PeagleError("speculative config must be a JSON object")
    unknown = set(spec) - KNOWN
    if unknown:
        raise PeagleError(f"unknown speculative config key(s): {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(KNOWN))})")
    method = spec.get("method")
    if method not in ("eagle3", "eagle"):
        raise PeagleError(f"speculative config method must be 'eagle3' (with parallel_drafting for P-EAGLE), "
                          f"got {method!r}")
    if not isinstance(spec.get("model"), str) or not spec["model"]:
        raise PeagleError("speculative config needs 'model': the drafter head directory")
    k = spec.get("num_speculative_tokens")
    if not (is_k(k) or k == AUTO):
        raise PeagleError(f"num_speculative_tokens must be an integer in 1..32 or \"auto\", got {k!r}")
    kmax = spec.get("max_num_speculative_tokens")
    if kmax is not None and (k != AUTO or not is_k(kmax)):
        raise PeagleError("max_num_speculative_tokens (an integer in 1..32) goes with \"num_speculative_tokens\": "
                          f"\"auto\", got {kmax!r} with num_speculative_tokens {k!r}")
    sched = spec.get("num_speculative_tokens_per_batch_size")
    if sched is not None:
        if k == AUTO:
            raise PeagleError("num_speculative_tokens_per_batch_size needs an integer num_speculative_tokens (the "
                              "largest K, as in vLLM), not \"auto\"")
        try:
            sched = [list(e) for e in validate_schedule(sched)]
        except ValueError as e:
            raise PeagleError(str(e)) from None
    auto_k = spec.get("auto_k")
    if auto_k is not None and (k != AUTO or not isinstance(auto_k, dict)):
        raise PeagleError(f"auto_k (a JSON object: auto K's settings) goes with \"num_speculative_tokens\": \"auto\", "
                          f"got {auto_k!r} with num_speculative_tokens {k!r}")
    pd = spec.get("parallel_drafting", False)
    if not isinstance(pd, bool):
        raise PeagleError(f"parallel_drafting must be true or false, got {pd!r}")
    tp = spec.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise PeagleError("draft_tensor_parallel_size must be 1 in peagle (single process)")
    ds = spec.get("draft_sampling", DEFAULT_DRAFT_SAMPLING)
    if ds not in DRAFT_SAMPLING:
        raise PeagleError(f"draft_sampling must be one of {', '.join(map(repr, DRAFT_SAMPLING))}, got {ds!r}")
    topk = spec.get("eagle_topk", 1)
    if not (isinstance(topk, int) and not isinstance(topk, bool) and 1 <= topk <= 64):
        raise PeagleError(f"eagle_topk must be an integer in 1..64, got {topk!r}")
    nd = spec.get("num_draft_tokens")
    if nd is not None and not (isinstance(nd, int) and not isinstance(nd, bool) and 1 <= nd <= 64):
        raise PeagleError(f"num_draft_tokens must be an integer in 1..64, got {nd!r}")
    return SpecConfig("eagle3", spec["model"], k, pd, kmax, sched, ds, topk, nd, auto_k=auto_k)
