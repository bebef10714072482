"""What `peagle tune` (peagle/cli/tune.py) computes: vLLM's `num_speculative_tokens_per_batch_size` for a head
from this machine's step costs t(B, K) and the head's measured acceptance.

1. Step costs t(B, K) for K = 0..k_max and batch sizes up to --max-num-seqs (the cost model "auto" uses,
   from the same cache).
2. Acceptance: greedy generation on --num-prompts prompts of --dataset with K = k_max gives P(accepted >= i)
   per position. The first i drafts do not depend on K >= i (EAGLE-3 drafts autoregressively, P-EAGLE's mask
   rows attend causally), so E[accepted + 1 | K] = 1 + sum_{i<=K} P(accepted >= i) for every K <= k_max.
3. For every batch size B, the K with the most expected tokens per second, E(K) / t(B, K) (K = 0 when no K
   beats plain decoding); consecutive batch sizes with the same K form one [start, end, K] range.
k_max: num_speculative_tokens if an integer; with "auto", max_num_speculative_tokens or the trained depth.
4. A parallel (P-EAGLE) head gets a two-level schedule unless asked otherwise: every batch size uses 0 or one
   K, and that K becomes num_speculative_tokens. vLLM <= 0.32 fills num_speculative_tokens mask slots whatever
   the step's K (the fix, vLLM PR #45695, is open), so a step with 0 < K < num_speculative_tokens crashes or
   verifies another request's drafts there (tests/vllm/test_vllm_schedule.py); K = 0 and K = the maximum work.
5. With token trees in the config (peagle's engine only; vLLM has none): the trees' acceptance and step costs are
   measured too, and peagle's choice per batch size among plain, chain K and tree K is printed beside the
   schedule (best_kind_per_batch); the written config stays vLLM's chains."""
from __future__ import annotations

import numpy as np


def expected_tokens(rate_per_pos: list) -> np.ndarray:
    """[k_max + 1]: E[accepted + 1 | K] from P(accepted >= i), i = 1..k_max."""
    return 1.0 + np.cumsum([0.0] + [float(x) for x in rate_per_pos])


def best_k_per_batch(expected: np.ndarray, cost, max_batch: int) -> list:
    """[K for B = 1..max_batch]: argmax_K E(K) / t(B, K) (the batch's tokens per second)."""
    k_max = expected.shape[0] - 1
    return [int((expected / cost.predict(b)[: k_max + 1]).argmax()) for b in range(1, max_batch + 1)]


def best_two_level(expected: np.ndarray, cost, max_batch: int) -> tuple[int, list]:
    """(k, [K for B = 1..max_batch]) with every K in {0, k}: for each k in 1..k_max, K = k where it beats plain
    decoding, else 0; the k whose schedule has the largest sum over B of expected speedup over plain decoding."""
    best = None
    for k in range(1, expected.shape[0]):
        ks, score = [], 0.0
        for b in range(1, max_batch + 1):
            t = cost.predict(b)
            spec, plain = expected[k] / t[k], expected[0] / t[0]
            ks.append(k if spec > plain else 0)
            score += max(spec, plain) / plain
        if best is None or score > best[0]:
            best = (score, k, ks)
    return best[1], best[2]


def best_kind_per_batch(chain: tuple, tree: tuple, max_batch: int) -> list:
    """chain / tree: (expected tokens [k_max + 1], cost model) of each kind of step -> [(kind, K) for B = 1..
    max_batch], kind "plain" (K = 0), "chain" or "tree": the most expected tokens per second."""
    out = []
    for b in range(1, max_batch + 1):
        best = ("plain", 0, chain[0][0] / chain[1].predict(b)[0])
        for kind, (e, cost) in (("chain", chain), ("tree", tree)):
            t = cost.predict(b)[: e.shape[0]]
            k = 1 + int((e[1:] / t[1:]).argmax())
            if e[k] / t[k] > best[2]:
                best = (kind, k, e[k] / t[k])
        out.append(best[:2])
    return out


def ranges(ks: list) -> list:
    """[K for B = 1..n] -> vLLM's [[start, end, K], ...] (inclusive, from 1)."""
    out = []
    for b, k in enumerate(ks, 1):
        if out and out[-1][2] == k:
            out[-1][1] = b
        else:
            out.append([b, b, k])
    return out
