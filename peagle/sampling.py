"""Sampling parameters and the one place where logits become tokens (reused by the verifier, and by the drafters
when they draw drafts from q: peagle/drafters/base.py)."""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass

import torch

from .errors import PeagleError
from .models import quant_ext


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, for every greedy token the engine emits or drafts (plain steps,
    verification, trees, drafts): the first maximum, a NaN counting as the maximum. On the CPU in float32 the
    extension's one-pass kernel (peagle/csrc/argmax.cpp: the same indices as torch's), else max(-1).indices (the same
    index as argmax in ~40 % of its time there). SmolLM2's 49152 logits on a 2-core Intel Xeon (AVX-512), per
    row: 3.8 / 26.5 / 62 us."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    ext = quant_ext.get()
    if ext is not None and logits.dtype == torch.float32 and logits.shape[-1] and hasattr(ext, "argmax_last"):
        return ext.argmax_last(logits)
    return logits.max(-1).indices


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


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
    seed: int | None = None     # repeats the output exactly under a fixed K (see peagle/verify.py)
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))) or not all(isinstance(s, str) for s in self.stop or []):
            raise PeagleError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))) or not all(
                _is_int(t) for t in self.stop_token_ids or []):
            raise PeagleError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise PeagleError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise PeagleError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise PeagleError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < -1):
            raise PeagleError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.top_k is None or self.top_k < 0 or self.top_k >= 2 ** 31:    # 2**31 and more: no vocabulary is
            self.top_k = 0                                                    # that large (and int64 may overflow)
        if not (self.max_tokens is None or _is_int(self.max_tokens)):
            raise PeagleError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not (self.seed is None or _is_int(self.seed)):
            raise PeagleError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise PeagleError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")    # "false" was true
        if self.max_tokens is not None and self.max_tokens < 1:
            raise PeagleError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not _is_int(self.n) or self.n != 1:
            raise PeagleError(f"only n=1 is supported, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def probs_from_logits(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """logits [..., V] -> the target distribution after temperature, top-k and top-p (fp32).

    Each parameter is a number, or a tensor broadcastable to logits[..., :1] holding one value per row
    (top_k 0 = off, top_p 1 = off): a batch of rows with different parameters is processed in one pass and
    gives exactly what each row's own call would."""
    V = logits.shape[-1]
    x = logits.float() / (temperature.clamp_min(1e-5) if torch.is_tensor(temperature) else max(temperature, 1e-5))
    if torch.is_tensor(top_k):
        k = torch.where((top_k > 0) & (top_k < V), top_k, V).long()
        kth = x.sort(-1, descending=True).values.gather(-1, (k - 1).expand(x.shape[:-1] + (1,)))
        x = x.masked_fill(x < kth, float("-inf"))
    elif top_k and top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if torch.is_tensor(top_p) or top_p < 1.0:
        x = _nucleus(x, top_p)
    return x.softmax(-1)


NUCLEUS = (128, 1024)   # on the CPU, top-p looks for its nucleus among this many top tokens before sorting them all


def _nucleus(x: torch.Tensor, top_p) -> torch.Tensor:
    """x [..., V] with the tokens past the top-p nucleus at -inf: the smallest prefix of the tokens sorted by
    probability (ties in index order) whose mass reaches top_p, the token crossing it kept. Each token's
    probability is exp(x - max) / sum(exp(x - max)) over the whole row (summed in float64), so the prefix sums of
    any number of top tokens are the same numbers: on the CPU a row's top n tokens (torch.topk, put in the stable
    order; n in NUCLEUS, smallest first) decide it wherever its nucleus ends inside them ahead of a strictly
    smaller logit; the other rows sort everything (SmolLM2's 49152 logits on a 2-core Intel Xeon: a full sort
    3.6 ms, topk of 128 0.14 ms, of 1024 0.56 ms). The same bits either way, whatever the other rows. Off the
    CPU every row is sorted (no host reads)."""
    V = x.shape[-1]
    flat = x.reshape(-1, V)
    tp = (top_p.expand(x.shape[:-1] + (1,)).reshape(-1, 1).to(flat.dtype) if torch.is_tensor(top_p)
          else torch.full((flat.shape[0], 1), float(top_p), dtype=flat.dtype, device=flat.device))
    m = flat.amax(-1, keepdim=True)
    z = (flat - m).exp().double().sum(-1, keepdim=True)   # float64: float32 sums of 49152 terms drifted by ~1e-5

    def cut(sx, rows):                                # sorted logits of these rows -> past the nucleus at -inf
        ps = (sx - m[rows]).exp().double() / z[rows]
        drop = ((ps.cumsum(-1) - ps) >= tp[rows]) & (tp[rows] < 1.0)
        drop[:, 0] = False                            # the top token always (top_p below fp32's tiniest)
        return sx.masked_fill(drop, float("-inf")), drop

    if flat.device.type != "cpu":                     # no host reads off the CPU: every row sorted
        sx, si = _sort_all(flat)
        return torch.full_like(sx, float("-inf")).scatter(-1, si, cut(sx, slice(None))[0]).reshape(x.shape)
    out, done = flat, tp[:, 0] >= 1.0                 # rows with top_p 1 keep every token
    every = slice(None)
    for n in NUCLEUS:
        if n >= V or bool(done.all()):
            break
        tv, ti = flat.topk(n, dim=-1)                 # descending, ties in no set order: put in index order
        ti, o = ti.sort(-1)
        tv, o = tv.gather(-1, o).sort(dim=-1, descending=True, stable=True)
        sx, drop = cut(tv, every)
        last = tv.gather(-1, (~drop).sum(-1, keepdim=True) - 1)     # the last kept logit
        ok = ~done & drop[:, -1] & (last[:, 0] > tv[:, -1])         # the nucleus ends inside, before a smaller one
        out = torch.where(ok[:, None], torch.full_like(flat, float("-inf")).scatter(-1, ti.gather(-1, o), sx), out)
        done = done | ok
    if not bool(done.all()):
        rows = (~done).nonzero()[:, 0]
        sx, si = _sort_all(flat[rows])
        out = out.index_copy(0, rows, torch.full_like(sx, float("-inf")).scatter(-1, si, cut(sx, rows)[0]))
    return out.reshape(x.shape)


def _sort_all(x: torch.Tensor):
    """Every token of each row by logit, descending, ties in index order (top-p's slow path)."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def sample_rows(probs: torch.Tensor, gens: list) -> torch.Tensor:
    """probs [N,...,V] -> [N,...] samples, row i (all its distributions) drawn with gens[i]: one float64 uniform u
    per distribution, the first token whose running sum of p (float64, in vocabulary order) exceeds u · sum(p),
    so P(x) = p(x) / sum(p) (p need not be normalised; a token with p = 0 is never drawn). No host
    synchronisation (torch.multinomial reads the probabilities back); one random number per token, where the
    exponential race drew V (SmolLM2's 49152 exponentials: 0.96 ms on a 2-core Intel Xeon)."""
    u = torch.stack([torch.rand(probs.shape[1:-1], generator=g, dtype=torch.float64, device=probs.device)
                     for g in gens])                                                    # [N,...]
    cs = probs.double().cumsum(-1)                                                      # [N,...,V]
    if cs.device.type != "cpu":      # a parallel scan: flat and non-decreasing after a p = 0 token, by construction
        cs = torch.where(probs > 0, cs, 0.0).cummax(-1).values
    total = cs[..., -1:]
    t = torch.minimum(u[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))   # t < sum(p)
    return torch.searchsorted(cs, t, right=True)[..., 0].clamp_(max=probs.shape[-1] - 1)


def sample_from(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """probs [N,V] -> [N] samples with one generator."""
    return sample_rows(probs, [gen] * probs.shape[0])


def unseeded_seed(engine_seed: int, n: int) -> int:
    """The seed of an engine's n-th request that came without one: a 64-bit hash of (engine seed, n), so it is
    no small number a user would pick (seed=n drew the same numbers as the n-th unseeded request before)."""
    h = hashlib.blake2b(f"peagle-unseeded:{int(engine_seed)}:{int(n)}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def make_generator(seed: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFFFFFFFFFFFFFF)
    return g
