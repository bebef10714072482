"""Measure t_step(B, K) on this machine: real engine decode steps with K forced, over a grid of batch sizes.

For each batch size B: B requests with random prompts of `ctx_len` tokens are admitted (untimed), then decode
steps run with K = 0..k_max forced: passes with K ascending (each K warmed up once) and descending in turn,
`steps` timed steps per K per pass; a cell is the median of its steps (the passes cancel the drift of the growing
context). Small batches get more passes (`small_passes` // B, at least 2): their steps are short, and at c=1
the choice turns on a few per cent (4 steps per cell put SmolLM2's K = 1 step at 1.05-1.26x a plain one in
four measurements: docs/benchmarks/auto/README.md). The grid is then made nondecreasing in K and B
(CostModel.monotone; the raw medians are kept). Times are what the engine reports to its K policy (the same
clock the online refinement uses).
Random prompts keep acceptance low, so every step carries about one new row per request, as in a
steady state.

K that cannot pay is not measured to the end: in the first ascending pass, once two K in a row have steps that
cost more than plain decoding's step times the tokens they would yield with every draft position accepted with
probability PAY_ALPHA (1 + a + ... + a^K), the second is the last measured at this batch size and the larger
ones are extrapolated linearly from the last two (`measured_k_max` in the model's meta; the first start's log
names them). Such cells only ever matter to a head accepting more than PAY_ALPHA at every position.

Also measured: the drafter's seconds per context row (`drafter_row_s`), from its prefill of one prompt-sized
block: the price of the catch-up a K > 0 step pays for rows the drafter skipped while K was 0 (a deferred
prompt). AutoK starts from it and then learns it from real catch-up steps."""
from __future__ import annotations

import statistics
import time

import torch

from ..device import synchronize
from ..drafters.base import DraftBatch
from ..kpolicy import KPolicy
from ..sampling import SamplingParams
from .costmodel import CostModel

PAY_ALPHA = 0.9    # the per-position acceptance beyond which a K's cost stops being measured (see above)


def max_tokens(k: int, alpha: float = PAY_ALPHA) -> float:
    """Tokens a step with k drafts yields when each draft position is accepted with probability alpha."""
    return sum(alpha ** i for i in range(k + 1))


def cannot_pay(plain_s: float, k_s: float, k: int, alpha: float = PAY_ALPHA) -> bool:
    """A K = k step of k_s seconds is slower than plain decoding (plain_s per step) even at acceptance alpha."""
    return k > 0 and k_s > plain_s * max_tokens(k, alpha)


def extrapolate(row: list, top: int) -> list:
    """row's cells beyond `top` continued linearly from cells top - 1 and top (never decreasing)."""
    if top + 1 >= len(row) or top < 1:
        return row
    slope = max(row[top] - row[top - 1], 0.0)
    return row[: top + 1] + [row[top] + slope * (k - top) for k in range(top + 1, len(row))]


def grid_batch_sizes(max_batch: int) -> list:
    """1, 2, 4, ... up to max_batch, and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class ForcedK(KPolicy):
    """K set from outside; records (B, K, seconds) of every step."""
    mode = "forced"

    def __init__(self, k_max):
        super().__init__(k_max)
        self.k, self.log = 0, []

    def choose(self, rows):
        return self.k

    def observe(self, rows, k, accepted, step_s, tree=False):
        self.log.append((len(rows), k, step_s))


def seconds_left(batch_sizes: list, i: int, seconds: float, small_passes: int) -> float:
    """An estimate, after measuring batch_sizes[i] in `seconds`, of the larger batch sizes still to measure: each
    priced in proportion to its passes and its rows, as if every K were measured there (before K that cannot pay
    were left out, `peagle serve`'s first start, SmolLM2 q4a8, 2-core Intel Xeon: after B = 1, 4, 32, 64 it said
    74, 49, 44, 31 s where 71, 69, 56, 41 s followed). So it is an upper bound where large batches stop early."""
    B, p = batch_sizes[i], passes_for(batch_sizes[i], small_passes)
    return sum(seconds * passes_for(b, small_passes) / p * b / B for b in batch_sizes[i + 1:])


def passes_for(B: int, small_passes: int) -> int:
    """Passes over K at batch size B: small_passes // B, even, at least 2."""
    return max(2, small_passes // B // 2 * 2)


def steps_per_batch(k_max: int, steps: int, passes: int = 2) -> int:
    return 4 + (k_max + 1) * (passes // 2) * (1 + 2 * steps)


def measure(target, make_engine, k_max: int, batch_sizes: list, ctx_len: int = 64, steps: int = 2, seed: int = 0,
            log=None, small_passes: int = 8) -> CostModel:
    """make_engine(policy, max_num_seqs, max_model_len, seed) -> a fresh engine of this target and the head,
    built for K = k_max, taking K from `policy` (peagle/llm.py measuring_engines)."""
    need = ctx_len + steps_per_batch(k_max, steps, passes_for(1, small_passes)) * (k_max + 1) + 8
    mlen = min(need, target.cfg.max_position_embeddings)
    policy = ForcedK(k_max)
    eng = make_engine(policy, max(batch_sizes), mlen, seed)
    g = torch.Generator().manual_seed(seed)
    vocab = target.cfg.vocab_size
    ctx = max(2, min(ctx_len, mlen // 4))
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    rows, samples, tops = [], [], []    # samples: the fewest timed steps behind a measured cell, per batch size
    t0 = time.perf_counter()
    row_s = drafter_row_seconds(eng.proposer, min(4 * ctx, mlen // 2), g)
    for bi, B in enumerate(batch_sizes):
        tb = time.perf_counter()
        for i in range(B):
            eng.add_request(f"m{B}-{i}", torch.randint(8, vocab, (ctx,), generator=g).tolist(), params)
        policy.k = 0
        while eng.waiting:
            eng.step()
        cells: dict = {k: [] for k in range(k_max + 1)}
        orders = [range(k_max + 1), range(k_max, -1, -1)] * (passes_for(B, small_passes) // 2)
        top = k_max                                              # the largest K measured at this B
        for p, order in enumerate(orders):
            for k in order:
                if k > top:
                    continue
                policy.k = k
                if order.step > 0:
                    eng.step()                                   # warm-up (and drafter catch-up after K = 0)
                for _ in range(steps):
                    n = len(policy.log)
                    eng.step()
                    if len(policy.log) == n:             # no decode step: the rows reached the context limit
                        break
                    b, kk, s = policy.log[n]
                    if b == B and kk == k:
                        cells[k].append(s)
                if p == 0 and k >= 2 and all(cells[0] and cells[j] and cannot_pay(
                        statistics.median(cells[0]), statistics.median(cells[j]), j) for j in (k - 1, k)):
                    top = k                                      # two in a row: one noisy step cuts nothing
        for r in list(eng.running):
            eng.abort(r.request_id)
        row = [statistics.median(cells[k]) if cells[k] else float("nan") for k in range(top + 1)]
        rows.append(extrapolate(row + [float("nan")] * (k_max - top), top))
        tops.append(top)
        samples.append(min(len(cells[k]) for k in range(top + 1)))
        if log:
            took = time.perf_counter() - tb
            left = seconds_left(batch_sizes, bi, took, small_passes)
            shown = " ".join(f"K{k}={1000 * t:.1f}ms" for k, t in enumerate(rows[-1][: top + 1]))
            rest = f"K{top + 1}" + (f"..{k_max}" if top + 1 < k_max else "")
            cut = (f"; {rest} extrapolated (K{top} would need acceptance > {PAY_ALPHA} per position to pay)"
                   if top < k_max else "")
            log(f"autok: measured B={B} in {took:.1f} s: {shown}{cut}"
                + (f" (at most about {left:.0f} s more)" if left >= 1 else ""))
    _fill_gaps(rows)
    return CostModel(batch_sizes, rows, meta={"measured_s": round(time.perf_counter() - t0, 1), "ctx_len": ctx,
                                              "steps_per_cell": 2 * steps, "small_passes": small_passes,
                                              "samples_per_cell": samples, "raw_seconds_per_step": rows,
                                              "measured_k_max": tops, "drafter_row_s": row_s}).monotone()


def drafter_row_seconds(proposer, n: int, g: torch.Generator, reps: int = 3) -> float | None:
    """Seconds per row of a drafter prefill over one block of n context rows (median of reps after a warm-up),
    written to rows the measuring engine never reads; None without a drafter."""
    if proposer is None or n < 1:
        return None
    head = proposer.head
    w = head.fc.weight                                     # [H, 3T]: the aux states' width
    db = DraftBatch(torch.randint(8, head.config.vocab_size, (1, n), generator=g).to(w.device),
                    torch.randn(1, n, w.shape[1], generator=g).to(w.device, w.dtype),
                    torch.zeros(1, dtype=torch.long, device=w.device), torch.full((1,), n, device=w.device),
                    span=n, s0=0)
    times = []
    for _ in range(reps + 1):
        synchronize(w.device)                              # a GPU's queued work timed where it runs, not queued
        t = time.perf_counter()
        proposer.prefill(db)
        synchronize(w.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) / n


def _fill_gaps(rows):
    """A cell with no sample (requests finished early: tiny context limits) takes its row's neighbour."""
    for row in rows:
        for k in range(len(row)):
            if row[k] != row[k]:
                near = [row[j] for j in sorted(range(len(row)), key=lambda j: abs(j - k)) if row[j] == row[j]]
                row[k] = near[0] if near else 1e-3
