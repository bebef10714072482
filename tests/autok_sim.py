"""A scripted engine for K policies: no model, no wall clock. It keeps the engine's bookkeeping that a policy
sees (requests with output_ids / params, and a stand-in proposer counting each one's drafter rows `behind`: a
K > 0 step leaves accepted + 1, a K = 0 step adds one, a request admitted while the policy is not drafting starts
its whole prompt behind) and charges
each step a scripted time:

  seconds = cost(B, K) x (1 + noise x uniform(-1, 1))
            + (K > 0: B x (most drafter rows behind - (k_max + 1)), the catch-up block beyond a steady step's)
              x catch_row_s

Acceptance per row comes from `accept(rng, K) -> accepted drafts` (0..K). Requests of `prompt` tokens generate
`max_tokens` each; a finished one is replaced at once, so B rows stay running. Plain decoding of the same tokens
takes tokens / B steps of cost(B, 0) (noise averages out): `run(...)["plain_s"]`."""
from __future__ import annotations

import random

import torch

from peagle.autok.config import AutoKConfig, GuardConfig
from peagle.sampling import SamplingParams


class Req:
    """What a policy reads of an engine Request."""

    def __init__(self, rid: str, max_tokens: int, behind: int):
        self.request_id, self.behind = rid, behind       # behind: the proposer's count, kept here for the sim
        self.params, self.output_ids = SamplingParams(max_tokens=max_tokens), []


class Backlog:
    """What a K policy asks the proposer (Proposer.catch_up_rows), answered from rows that carry `behind`."""

    def __init__(self, rows: list):
        self.rows = rows

    def catch_up_rows(self, batch_size: int, steady: int) -> int:
        return batch_size * max(0, max((r.behind for r in self.rows[:batch_size]), default=0) - steady)


def geometric(alpha: float):
    """Each draft accepted with probability alpha given the ones before it were."""
    def accept(rng, k):
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        return a
    return accept


def run(policy, steps: int, cost, accept, batch: int = 1, max_tokens: int = 256, prompt: int = 32,
        catch_row_s: float = 0.0, noise: float = 0.0, seed: int = 0) -> dict:
    """Run `steps` decode steps. -> {"k": K per step, "seconds", "tokens", "plain_s" (plain decoding's time for
    the same tokens: tokens / B steps of cost(B, 0)), "vs_plain" (plain_s / seconds), "first_draft": the first
    step with K > 0 (None if none), "first_zero_run": the first step from then on from which K stayed 0 for 16
    steps (None if never: the guard's first plain reference before any drafting does not count)}."""
    rng, nrng = random.Random(seed), random.Random(seed + 1)
    k_max, n = policy.k_max, 0
    rows = []
    policy.attach(Backlog(rows))

    def admit():
        nonlocal n
        drafts = policy.drafts_next(batch)
        rows.append(Req(f"r{n}", max_tokens, 1 if drafts else prompt))
        n += 1
    for _ in range(batch):
        admit()
    ks, secs, toks = [], 0.0, 0
    for _ in range(steps):
        B = len(rows)
        k = min(max(int(policy.choose(rows)), 0), k_max)
        extra = B * max(0, max(r.behind for r in rows) - (k_max + 1)) if k else 0
        s = cost(B, k) * (1.0 + noise * (2 * nrng.random() - 1)) + extra * catch_row_s
        acc = [accept(rng, k) if k else 0 for _ in rows]
        for r, a in zip(rows, acc):
            add = min(a + 1, max_tokens - len(r.output_ids))
            r.output_ids += [0] * add
            toks += add
            r.behind = a + 1 if k else r.behind + 1
        policy.observe(rows, k, torch.tensor(acc, dtype=torch.long), s)
        ks.append(k)
        secs += s
        done = [r for r in rows if len(r.output_ids) >= max_tokens]
        for r in done:
            rows.remove(r)
        for _ in done:
            admit()
    plain_s = toks / batch * cost(batch, 0)
    # the first step that drafts (after the guard's first plain reference), and the first run of 16 K = 0 steps
    # after it: where drafting stopped
    drafted = next((i for i, k in enumerate(ks) if k), None)
    first = None if drafted is None else next(
        (i for i in range(drafted, len(ks) - 15) if not any(ks[i:i + 16])), None)
    return {"k": ks, "seconds": secs, "tokens": toks, "plain_s": plain_s, "vs_plain": plain_s / secs,
            "first_draft": drafted, "first_zero_run": first}


def autok_config(guard=True, **kw) -> AutoKConfig:
    """AutoKConfig in the tests' short form: guard True / False (GuardConfig(enabled=...)) or a dict of
    GuardConfig fields; the rest are AutoKConfig's fields."""
    g = GuardConfig(enabled=guard) if isinstance(guard, bool) else GuardConfig(**guard)
    return AutoKConfig(guard=g, **kw)
