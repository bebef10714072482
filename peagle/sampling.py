"""Sampling parameters and the one place where logits become tokens (reused by the verifier)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import PeagleError


@dataclass
class SamplingParams:
    """Same names and defaults as vLLM's SamplingParams."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 or -1: off
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < 0:
            raise PeagleError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise PeagleError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.max_tokens is not None and self.max_tokens < 1:
            raise PeagleError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n != 1:
            raise PeagleError("only n=1 is supported")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [..., V] -> the target distribution after temperature, top-k and top-p (fp32)."""
    x = logits.float() / max(temperature, 1e-5)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sx, si = torch.sort(x, dim=-1, descending=True)
        cum = sx.softmax(-1).cumsum(-1)
        drop = (cum - sx.softmax(-1)) >= top_p      # keep the smallest prefix reaching top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, si, sx)
    return x.softmax(-1)


def sample_from(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """probs [N,V] -> [N] samples with one generator."""
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) & 0xFFFFFFFFFFFFFFFF)
    return g
