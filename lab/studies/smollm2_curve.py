"""Held-out acceptance of the SmolLM2 heads vs the training tokens behind them (docs/training-study.md, SmolLM2).

    .venv/bin/python lab/studies/smollm2_curve.py

Tokens seen = optimizer steps x 1,024-token rows, summed over the training parts (train_log*.jsonl of each
head). Acceptance = `peagle bench`'s mean acceptance length at K=7, greedy, 4 prompts x 64 tokens per dataset,
from the reports each part's card cites (parts 1-2: docs/benchmarks/smollm2/report.md at the commits that
shipped them; part 3: the current report)."""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
# (head, part): (HumanEval AL@7, MT-Bench AL@7), as recorded in the heads' cards and reports
AL = {("peagle", 1): (1.30, 1.35), ("peagle", 2): (1.35, 1.36),
      ("eagle3", 1): (1.24, 1.28), ("eagle3", 2): (1.25, 1.30)}
PART3 = os.path.join(ROOT, "docs", "training-study", "smollm2", "part3_acceptance.json")


def steps(head: str) -> list[int]:
    d = os.path.join(ROOT, "models", f"smollm2-135m-instruct-{head}")
    out = []
    for fn in ("train_log.jsonl", "train_log_part2.jsonl", "train_log_part3.jsonl"):
        p = os.path.join(d, fn)
        if os.path.isfile(p):
            lines = [json.loads(x) for x in open(p) if x.strip()]
            out.append(lines[-1]["step"])
    return out


def main():
    if os.path.isfile(PART3):
        for head, v in json.load(open(PART3)).items():
            AL[(head, 3)] = tuple(v)
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = ["| head | part | tokens seen (M) | AL@7 HumanEval | AL@7 MT-Bench |", "|---|---|---|---|---|"]
    for head, label in (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3")):
        seen, x, y = 0, [], []
        for part, s in enumerate(steps(head), 1):
            seen += s * 1024
            if (head, part) in AL:
                x.append(seen / 1e6)
                y.append(sum(AL[(head, part)]) / 2)
                rows.append(f"| {label} | {part} | {seen / 1e6:.2f} | {AL[(head, part)][0]:.2f} | {AL[(head, part)][1]:.2f} |")
        ax.plot(x, y, "o-", label=label)
    ax.set_xlabel("training tokens seen (M, rows x 1,024)")
    ax.set_ylabel("acceptance length at K=7 (mean of HumanEval, MT-Bench)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = os.path.join(ROOT, "docs", "training-study", "smollm2", "al_vs_tokens.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("\n".join(rows))
    print(f"wrote {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
