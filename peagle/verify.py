"""Verification: the target scored [last, d1..dK] in one pass; keep the longest valid prefix plus one token.

Greedy rows accept a draft iff it equals the target's argmax. Sampled rows use rejection sampling with
argmax (one-hot) drafts, exactly as vLLM >= 0.16: accept d_i with probability p_i(d_i); on rejection emit a
sample of p_i with d_i removed (renormalised); if all K pass, emit a sample of p_K (the bonus token).
P(emit x) = p(x) at every position, so sampling is lossless."""
from __future__ import annotations

import torch

from .sampling import probs_from_logits, sample_from


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor):
    """logits [B,K+1,V], drafts [B,K] -> (accepted counts [B], emitted tokens [B,K+1]; row b emits
    tokens[b, :accepted[b]+1])."""
    target = logits.argmax(-1)                       # [B,K+1]
    K = drafts.shape[1]
    match = (drafts == target[:, :K]).long()
    accepted = match.cumprod(1).sum(1)               # length of the agreeing prefix
    return accepted, target                           # target[:, :a] == drafts[:, :a]; target[:, a] = correction/bonus


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, temperature, top_k, top_p, gen):
    """One row: logits [K+1,V], drafts [K] -> (accepted, emitted list)."""
    K = drafts.shape[0]
    p = probs_from_logits(logits, temperature, top_k, top_p)          # [K+1,V]
    out = []
    for i in range(K):
        d = int(drafts[i])
        u = torch.rand((), generator=gen, dtype=torch.float64)
        if u <= p[i, d].double():
            out.append(d)
            continue
        resid = p[i].clone()
        resid[d] = 0.0
        s = resid.sum()
        resid = resid / s if s > 0 else p[i]
        out.append(int(sample_from(resid[None], gen)[0]))
        return i, out
    out.append(int(sample_from(p[K:K + 1], gen)[0]))
    return K, out
