"""Verification: the target scored [last, d1..dK] in one pass; keep the longest valid prefix plus one token.

Invariant: every emitted token is distributed exactly as plain decoding would emit it (greedy: the target's
argmax; sampled: the processed target distribution p, after temperature / top-k / top-p), whatever the drafts.
Everything is batched over rows and draft positions and stays on the device (no host reads).

Greedy rows accept a draft iff it equals the target's argmax. Sampled rows use rejection sampling, in one of
two modes (the speculative config's "draft_sampling", see peagle/spec_config.py):
  argmax (q = None): one-hot drafts, exactly as vLLM >= 0.16 (its v1/sample/rejection_sampler.py): accept d_i
    with probability p_i(d_i); at the first rejection emit a sample of p_i with d_i removed (renormalised);
  sample (q [S,K,V]: the drafter's distributions over the target vocabulary, d_i ~ q_i): accept d_i with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a sample of the residual
    (p_i - q_i)+ renormalised (Leviathan et al. 2023, Chen et al. 2023). A one-hot q is the argmax mode.
If all K pass, emit a sample of p_K (the bonus token). P(emit x) = p(x) at every position in both modes, so
sampling is lossless; the sample mode accepts sum_x min(p(x), q(x)) per position instead of p(d).
K = 0 is plain sampling (the bonus token only), and prefill's first token is that case too.

Random numbers: each sampled row draws K uniforms and then one more (for the one token it emits) from
its own request's generator (after the draws of its drafts in the sample mode). How many it draws follows the
step's K, so a seeded request repeats its output exactly where K does not depend on the batch (a fixed K, or
plain decoding), whatever its neighbours; where the K policy picks K by batch size or measured step time
(auto K, a tuned schedule), the same seed may give another sample (from the same distribution)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import quant_ext
from .sampling import greedy, probs_from_logits, sample_rows


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor):
    """logits [B,K+1,V], drafts [B,K] -> (accepted counts [B], emitted tokens [B,K+1]; row b emits
    tokens[b, :accepted[b]+1])."""
    target = greedy(logits)                          # [B,K+1]
    K = drafts.shape[1]
    match = (drafts == target[:, :K]).long()
    accepted = match.cumprod(1).sum(1)               # length of the agreeing prefix
    return accepted, target                           # target[:, :a] == drafts[:, :a]; target[:, a] = correction/bonus


def verify_greedy_advance(logits: torch.Tensor, drafts: torch.Tensor, last: torch.Tensor, lens: torch.Tensor,
                          impl: int = 0) -> torch.Tensor:
    """verify_greedy and the rows' advance in one: logits [B,K+1,V], drafts [B,K] -> [B,K+2] (accepted, then the
    K+1 target tokens); in place, for b < B: last[b] = the token after the accepted drafts, lens[b] += accepted
    + 1. On the CPU in float32 one call of the extension (peagle/csrc/argmax.cpp: greedy's argmax, so the same
    tokens), which after a step's weight stream saves the cache misses of ~8 torch ops; elsewhere those ops.
    impl (tests): the extension's paths (peagle/csrc/ops.h), -1 the torch ops."""
    ext = quant_ext.get() if impl >= 0 else None
    if (ext is not None and hasattr(ext, "verify_greedy_advance") and logits.device.type == "cpu"
            and logits.dtype == torch.float32 and lens.dtype == torch.long):
        return ext.verify_greedy_advance(logits, drafts, last, lens, impl)
    accepted, tokens = verify_greedy(logits, drafts)
    B = tokens.shape[0]
    last[:B] = tokens.gather(1, accepted[:, None])[:, 0]
    lens[:B] += accepted + 1
    return torch.cat([accepted[:, None], tokens], 1)


@dataclass
class SampledRows:
    """The sampled (temperature > 0) rows of a batch with their parameters, built on the host when the batch's
    membership changes and reused every step. rows: their indices in the batch (host); the tensors are
    [S,1,1] on the device; top_k / top_p are plain numbers (0 / 1.0: off) when no row uses them."""
    rows: list
    index: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor | int
    top_p: torch.Tensor | float
    gens: list

    @classmethod
    def of(cls, requests: list, device) -> "SampledRows | None":
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not rows:
            return None
        ps = [requests[i].params for i in rows]

        def col(xs, dtype):
            return torch.tensor(xs, dtype=dtype, device="cpu").to(device).view(-1, 1, 1)
        top_k = col([p.top_k for p in ps], torch.long) if any(p.top_k for p in ps) else 0
        top_p = col([p.top_p for p in ps], torch.float32) if any(p.top_p < 1.0 for p in ps) else 1.0
        return cls(rows, torch.tensor(rows, device="cpu").to(device), col([p.temperature for p in ps], torch.float32),
                   top_k, top_p, [requests[i].gen for i in rows])


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, s: SampledRows, q: torch.Tensor | None = None):
    """logits [S,K+1,V] and drafts [S,K] of the sampled rows, q [S,K,V] the distributions the drafts were drawn
    from (None: argmax drafts) -> (accepted [S], tokens [S,K+1]); row i emits tokens[i, :accepted[i]+1] (the
    accepted drafts, then the recovered or bonus token)."""
    S, K1, V = logits.shape
    K = K1 - 1
    p = probs_from_logits(logits, s.temperature, s.top_k, s.top_p)                      # [S,K+1,V]
    if not K:                                                  # plain sampling (a prefill's first token too)
        return torch.zeros(S, dtype=torch.long, device=logits.device), sample_rows(p, s.gens)
    u = torch.stack([torch.rand(K, generator=g, dtype=torch.float64, device=logits.device) for g in s.gens])
    p_draft = p[:, :K].gather(-1, drafts[..., None])[..., 0].double()                    # p_i(d_i), [S,K]
    if q is None:
        ok = u < p_draft                  # P(u < p) = p for u uniform on [0, 1): a draft with p = 0 never passes
    else:                                                                                 # u < p/q, no division
        ok = u * q.gather(-1, drafts[..., None])[..., 0].double() < p_draft
    accepted = ok.long().cumprod(1).sum(1)                                               # [S]
    # the emitting position: the first rejection (the residual there) or the bonus position K (p)
    rows = torch.arange(S, device=logits.device)
    dist = p[rows, accepted]                                                              # [S,V]
    rejected = accepted < K
    at = accepted.clamp(max=K - 1)
    if q is None:
        d_at = drafts[rows, at]
        dist = torch.where(rejected[:, None] & (torch.arange(V, device=logits.device) == d_at[:, None]), 0.0, dist)
    else:
        resid = (dist - q[rows, at]).clamp_min(0.0)                                      # (p - q)+, [S,V]
        # a zero residual means p == q: no rejection in exact arithmetic, only by rounding; p is right then
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, dist)
        dist = torch.where(rejected[:, None], resid, dist)
    # dist renormalised (argmax mode: a zero-sum residual cannot occur, a draft with p = 1 is always accepted)
    emitted = sample_rows(dist, s.gens)
    tokens = torch.cat([drafts, emitted[:, None]], 1)
    tokens[rows, accepted] = emitted
    return accepted, tokens
