"""vLLM's --speculative-config JSON: parsed and checked with the same keys and meaning."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import PeagleError

KNOWN = {"method", "model", "num_speculative_tokens", "parallel_drafting", "draft_tensor_parallel_size",
         "max_model_len", "disable_padded_drafter_batch"}


def speculative_config(head, k: int, parallel: bool) -> dict:
    """vLLM's speculative config for a head in the EAGLE-3 layout (P-EAGLE: parallel_drafting)."""
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": int(k), "parallel_drafting": bool(parallel)}


@dataclass
class SpecConfig:
    method: str
    model: str
    num_speculative_tokens: int
    parallel_drafting: bool = False

    @property
    def name(self) -> str:
        return "peagle" if self.parallel_drafting else "eagle3"


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
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
        raise PeagleError(f"num_speculative_tokens must be an integer in 1..32, got {k!r}")
    pd = spec.get("parallel_drafting", False)
    if not isinstance(pd, bool):
        raise PeagleError(f"parallel_drafting must be true or false, got {pd!r}")
    tp = spec.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise PeagleError("draft_tensor_parallel_size must be 1 in peagle (single process)")
    return SpecConfig("eagle3", spec["model"], k, pd)
