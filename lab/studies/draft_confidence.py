"""Whether a drafter's own probabilities say which drafts the target will accept, and what verifying only the
confident prefix of a chain would gain (issue 38 / 40: the shipped SmolLM2 heads).

Greedy decoding of held-out prompts (HumanEval, MT-Bench), one request at a time, each head at --k: per step, the
drafter's probability of each slot's draft (the softmax over the draft vocabulary at its argmax; P-EAGLE: the one
pass's slots, EAGLE-3: each pass's) and how many drafts the target accepted. Reported: per slot, the acceptance of
the drafts that reached it by probability bucket (calibration), and per threshold tau and depth what a gate that
verifies only the prefix whose cumulative probability stays >= tau would give -- acceptance length and drafts
verified per step, from the same steps (the gate drafts the same tokens and verifies fewer: lossless; the drafter's
pass is paid on every step either way). The drafts are the engine's; the Python path runs the head so that its
logits can be read (the one-call pass gives the same drafts without them).

    OMP_NUM_THREADS=2 .venv/bin/python lab/studies/draft_confidence.py --prompts 16 --tokens 96 \\
        --out docs/benchmarks/draft-confidence.md
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report
from peagle.data.benchmarks import encode_prompt, load_dataset
from peagle.llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
from peagle.sampling import SamplingParams

BUCKETS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001)
TAUS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)


def record(llm: LLM, prompts: list, tokens: int) -> list[tuple[list[float], int]]:
    """[(each slot's draft probability in drafting order, accepted drafts)] per decode step that drafted."""
    eng = llm.engine
    head = eng.proposer.head
    head._pass = None                        # the Python path, whose draft logits can be read
    probs: list[float] = []
    steps: list[tuple[list[float], int]] = []
    logits = head.draft_logits

    def seen(normed):
        lg = logits(normed)
        probs.extend(torch.softmax(lg.float(), -1).amax(-1).reshape(-1).tolist())
        return lg
    head.draft_logits = seen
    observe = eng.k_policy.observe

    def observed(rows, k, accepted, step_s, tree=False):
        if k:
            steps.append((list(probs), int(accepted[0])))
        probs.clear()
        return observe(rows, k, accepted, step_s, tree)
    eng.k_policy.observe = observed
    tok = llm.get_tokenizer()
    for i, p in enumerate(prompts):
        probs.clear()
        eng.add_request(f"c{i}", encode_prompt(tok, eng.target.cfg.vocab_size, p),
                        SamplingParams(temperature=0.0, max_tokens=tokens))
        while eng.has_unfinished():
            eng.step()
    return steps


def calibration(steps, slots: int) -> list[str]:
    lines = ["| slot | " + " | ".join(f"p in [{lo:.1f}, {min(hi, 1.0):.1f})" for lo, hi in zip(BUCKETS, BUCKETS[1:]))
             + " |", "|---|" + "---|" * (len(BUCKETS) - 1)]
    for j in range(slots):
        cells = []
        for lo, hi in zip(BUCKETS, BUCKETS[1:]):
            sel = [a > j for p, a in steps if len(p) > j and a >= j and lo <= p[j] < hi]   # drafts that reached j
            cells.append(f"{100 * sum(sel) / len(sel):.0f} % ({len(sel)})" if sel else "-")
        lines.append(f"| {j + 1} | " + " | ".join(cells) + " |")
    return lines


def gate(steps, depths) -> list[str]:
    lines = ["| tau | " + " | ".join(f"K={k}: AL / drafts per step" for k in depths) + " |",
             "|---|" + "---|" * len(depths)]
    for tau in TAUS:
        cells = []
        for k in depths:
            got = drafted = 0
            for p, a in steps:
                cum, n = 1.0, 0
                for j in range(min(k, len(p))):
                    cum *= p[j]
                    if cum < tau:
                        break
                    n += 1
                got += min(a, n) + 1
                drafted += n
            cells.append(f"{got / len(steps):.3f} / {drafted / len(steps):.2f}")
        lines.append(f"| {tau:.1f} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16, help="per dataset")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    base = LLM(model=a.model, quantization=a.quantization)
    heads = {"P-EAGLE": {"model": DEFAULT_PEAGLE_HEAD, "parallel_drafting": True},
             "EAGLE-3": {"model": DEFAULT_EAGLE3_HEAD}}
    lines = [f"# Do the drafters' probabilities predict acceptance? ({os.path.basename(a.model.rstrip('/'))}, "
             f"{base.engine.target.precision})", "",
             f"CPU: {cpu_flags()}; greedy, one request at a time, K={a.k}, {a.prompts} held-out prompts per dataset x "
             f"{a.tokens} tokens. Calibration: of the drafts that reached slot j (every draft before it accepted), "
             "the share the target accepted, by the drafter's probability of the draft (drafts in brackets). Gate: "
             "verify only the prefix whose cumulative probability stays >= tau (tau 0: the whole chain): acceptance "
             "length and drafts verified per step, from the same steps.", ""]
    depths = sorted({1, 2, 3, a.k})
    for name, spec in heads.items():
        llm = base.with_speculative_config({"method": "eagle3", "num_speculative_tokens": a.k, **spec})
        for ds in ("humaneval", "mtbench"):
            steps = record(llm, load_dataset(ds, a.prompts), a.tokens)
            lines += [f"## {name}, {ds} ({len(steps)} steps)", "", *calibration(steps, min(a.k, 3)), "",
                      *gate(steps, depths), ""]
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/studies/draft_confidence.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
