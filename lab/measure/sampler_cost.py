"""What sampling a token costs on the CPU: the sampler's ops side by side with the previous ones, and a plain
decode step sampled against a greedy one (docs/sampling.md).

1. Per token, on the default target's own logits (one row per position of a held-out prompt's forward), min
   over --rounds of the mean over the rows: the previous sampler -- top-p by a stable sort of all V logits, the
   token by the exponential race argmax(p / e) over V exponentials, written out below -- against peagle's
   (peagle.sampling: top-p from the top 128 / 1024 tokens where the nucleus ends inside them, the token by
   inverse CDF from one float64 uniform); the two samplers' probabilities compared too.
2. Plain decoding of one request (a 32-token prompt, --tokens tokens, EOS ignored) greedy, at temperature 0.7,
   and at 0.7 with top_p 0.9: the median engine step from step 50 on, per request, cases alternating (reversed
   every other round, the first round untimed); medians over the rounds and the ratio to greedy.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/sampler_cost.py --out docs/benchmarks/sampler-cost.md

Quick check that it runs (numbers meaningless): --tokens 56 --rounds 2 --rows 4.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.cpu_step import heldout_texts
from lab.measure.precision import cpu_flags, write_report
from lab.measure.slow_start import StepClock, run_cases
from peagle.llm import DEFAULT_MODEL, LLM
from peagle.sampling import SamplingParams, probs_from_logits, sample_rows

CASES = {"T=0.7": dict(temperature=0.7), "T=0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
         "T=1.0, top_p 0.95": dict(temperature=1.0, top_p=0.95)}


def previous_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The previous top-p: every logit sorted (stable, descending), the mass before each token from a softmax
    of the sorted row, the tokens whose mass before reaches top_p dropped (the top one kept)."""
    x = logits.float() / temperature
    if top_p < 1.0:
        sx, si = torch.sort(x, dim=-1, descending=True, stable=True)
        ps = sx.softmax(-1)
        drop = (ps.cumsum(-1) - ps) >= top_p
        drop[..., 0] = False
        x = torch.full_like(x, float("-inf")).scatter(-1, si, sx.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def previous_sample(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The previous draw: argmax(p / e) over V Exp(1) draws (the exponential race)."""
    e = torch.empty_like(p).exponential_(generator=gen).clamp_min_(torch.finfo(p.dtype).tiny)
    return (p / e).argmax(-1)


def per_token_ms(fn, rows: torch.Tensor, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for r in rows:
            fn(r[None])
        best = min(best, (time.perf_counter() - t0) / len(rows) * 1e3)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=160, help="table 2: tokens decoded per request")
    p.add_argument("--rounds", type=int, default=7, help="rounds of each table (table 2: the first untimed)")
    p.add_argument("--rows", type=int, default=64, help="table 1: logit rows (positions of a held-out prompt)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    llm = LLM(model=a.model)
    target = llm.engine.target
    gen = torch.Generator().manual_seed(0)
    ids = ([t for x in heldout_texts(400, llm.tokenizer) for t in x][: a.rows] if llm.tokenizer is not None else
           torch.randint(100, target.cfg.vocab_size, (a.rows,), generator=gen).tolist())   # a model without one
    logits, _ = target.forward(torch.tensor([ids]), target.new_cache(1, len(ids) + 1), 0,
                               torch.zeros(1, dtype=torch.long), span=len(ids))
    rows = logits[0].float()                                                        # [rows, V]

    t1 = {}
    for name, kw in CASES.items():
        T, tp = kw["temperature"], kw.get("top_p", 1.0)
        old = per_token_ms(lambda r: previous_sample(previous_probs(r, T, tp), gen), rows, a.rounds)
        new = per_token_ms(lambda r: sample_rows(probs_from_logits(r, T, 0, tp), [gen]), rows, a.rounds)
        diff = float((previous_probs(rows, T, tp) - probs_from_logits(rows, T, 0, tp)).abs().max())
        kept = float((probs_from_logits(rows, T, 0, tp) > 0).sum(-1).float().median())
        t1[name] = (old, new, diff, kept)

    clock = StepClock(llm.engine)
    prompt = torch.randint(100, target.cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)}
    params.update({n: SamplingParams(max_tokens=a.tokens, ignore_eos=True, seed=1, **kw) for n, kw in CASES.items()})
    skip = min(50, a.tokens // 2)
    curves = run_cases(llm, clock, {n: lambda: None for n in params}, lambda n: prompt, params, a.rounds)
    t2 = {n: statistics.median(statistics.median(c[skip:]) * 1e3 for c in cs) for n, cs in curves.items()}

    name = os.path.basename(a.model.rstrip("/"))
    lines = [f"# What sampling a token costs ({name}, {target.precision})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads.", "",
             f"**1. The sampler alone**, per token on the target's logits at {len(rows)} positions of a held-out "
             f"prompt (vocabulary {rows.shape[-1]}; min of {a.rounds} rounds of the mean over the rows): the "
             "previous sampler (top-p by sorting every logit, the token by the exponential race over V "
             "exponentials) against peagle's (top-p from the top 128 / 1024 tokens where the nucleus ends inside "
             "them, the token by inverse CDF from one uniform). A difference of p is a token at the top-p cut: the "
             "previous sampler's float32 sums of the sorted probabilities drift by ~1e-5 where peagle sums in "
             "float64 (checked against float64: peagle's cut is the rule's).", "",
             "| case | previous (ms) | peagle (ms) | previous ÷ peagle | tokens kept (median) | max abs difference of p |",
             "|---|---|---|---|---|---|"]
    for n, (old, new, diff, kept) in t1.items():
        lines.append(f"| {n} | {old:.3f} | {new:.3f} | {old / new:.1f}x | {kept:.0f} | {diff:.1e} |")
    lines += ["", f"**2. A plain decode step** (one request, a 32-token prompt, {a.tokens} tokens; the median step "
              f"from step {skip + 1} on, medians over {a.rounds - 1} timed rounds, cases alternating):", "",
              "| decoding | step (ms) | ÷ greedy |", "|---|---|---|"]
    for n, ms in t2.items():
        lines.append(f"| {n} | {ms:.3f} | {ms / t2['greedy']:.2f}x |")
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/sampler_cost.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
