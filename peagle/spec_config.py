"""vLLM's --speculative-config JSON: parsed and checked with the same keys and meaning, plus choosing K:
`"num_speculative_tokens": "auto"` (peagle: K per step, see peagle.autok), optionally bounded by
`"max_num_speculative_tokens"`, and vLLM's explicit `"num_speculative_tokens_per_batch_size"` schedule
(with an integer num_speculative_tokens, the largest K, as in vLLM); and how sampled rows draft (peagle):
`"draft_sampling": "sample"` (the default: drafts drawn from the drafter's distribution q, verified with
min(1, p/q) and the (p - q)+ residual; peagle/drafters/base.py, peagle/verify.py) or `"argmax"` (argmax drafts
verified as one-hot drafts: vLLM's behaviour and its acceptance counts at temperature > 0). Both are lossless;
greedy rows (temperature 0) draft and verify the same in both. The key is peagle's: `as_dict()` leaves the
default out, and `peagle tune` never writes it (vLLM has no such key)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import PeagleError
from .kpolicy import validate_schedule

KNOWN = {"method", "model", "num_speculative_tokens", "parallel_drafting", "draft_tensor_parallel_size",
         "max_model_len", "disable_padded_drafter_batch", "num_speculative_tokens_per_batch_size",
         "max_num_speculative_tokens", "draft_sampling"}
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
    draft_sampling: str = DEFAULT_DRAFT_SAMPLING  # "argmax" | "sample" (peagle only)

    @property
    def name(self) -> str:
        return "peagle" if self.parallel_drafting else "eagle3"

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
        if self.draft_sampling != DEFAULT_DRAFT_SAMPLING:    # the default stays out: the dict vLLM gets is vLLM's
            d["draft_sampling"] = self.draft_sampling
        return d


def _k(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 32


def parse_spec_config(spec) -> SpecConfig | None:
    if spec is None or spec == "" or spec == {}:
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
    if not (_k(k) or k == AUTO):
        raise PeagleError(f"num_speculative_tokens must be an integer in 1..32 or \"auto\", got {k!r}")
    kmax = spec.get("max_num_speculative_tokens")
    if kmax is not None and (k != AUTO or not _k(kmax)):
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
    pd = spec.get("parallel_drafting", False)
    if not isinstance(pd, bool):
        raise PeagleError(f"parallel_drafting must be true or false, got {pd!r}")
    tp = spec.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise PeagleError("draft_tensor_parallel_size must be 1 in peagle (single process)")
    ds = spec.get("draft_sampling", DEFAULT_DRAFT_SAMPLING)
    if ds not in DRAFT_SAMPLING:
        raise PeagleError(f"draft_sampling must be one of {', '.join(map(repr, DRAFT_SAMPLING))}, got {ds!r}")
    return SpecConfig("eagle3", spec["model"], k, pd, kmax, sched, ds)
