"""Held-out acceptance of the SmolLM2 heads vs the training tokens behind them (docs/training-study.md, SmolLM2).

    .venv/bin/python lab/studies/smollm2_curve.py

Tokens seen = optimizer steps x 1,024-token rows, summed over the training parts (train_log*.jsonl of each
head). Acceptance = `peagle bench`'s mean acceptance length at K=7, greedy, 4 prompts x 64 tokens per dataset,
from the reports each part's card cites (parts 1-2: docs/benchmarks/smollm2/report.md at the commits that
shipped them; part 3: the current report).

Part 4 adds a finer curve: the engine's held-out acceptance per position 1..5 at K=5 (greedy, 30 MT-Bench + 30
HumanEval prompts x 96 tokens, `python -m peagle.train.evaluate_heads --k 5 --max-tokens 96 --mtbench 30
--humaneval 30 --speed-prompts 0`) of part 3's heads and of part 4's checkpoints part-way (lab/studies/
ckpt_to_head.py) and at the end, recorded in docs/training-study/smollm2/part4_curve.json by

    .venv/bin/python lab/studies/smollm2_curve.py --add-point LABEL EVAL_JSON EAGLE3_STEPS PEAGLE_STEPS

(steps = optimizer steps after part 3 behind each evaluated head: part 4's, then part 4's 2,089 / 1,888 plus
part 5's for the part-5 study on the larger data set, which was not shipped)."""
from __future__ import annotations

import argparse
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
PART4 = os.path.join(ROOT, "docs", "training-study", "smollm2", "part4_curve.json")
NAMES = (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3"))


def steps(head: str) -> list[int]:
    d = os.path.join(ROOT, "models", f"smollm2-135m-instruct-{head}")
    out = []
    for fn in ("train_log.jsonl", "train_log_part2.jsonl", "train_log_part3.jsonl", "train_log_part4.jsonl"):
        p = os.path.join(d, fn)
        if os.path.isfile(p):
            lines = [json.loads(x) for x in open(p) if x.strip()]
            out.append(lines[-1]["step"])
    return out


def add_point(label: str, eval_json: str, e3_steps: int, pe_steps: int) -> None:
    ev = json.load(open(eval_json))
    pts = json.load(open(PART4)) if os.path.isfile(PART4) else []
    pts = [p for p in pts if p["label"] != label]
    pts.append({"label": label, "k": ev["k"], "part4_steps": {"eagle3": e3_steps, "peagle": pe_steps},
                "acceptance": {ds: {h: {"al": r[h]["acceptance_length"], "per_pos": r[h]["acceptance_per_pos"],
                                        "identical": r[h]["identical"]}
                                    for h, _ in NAMES if h in r}
                               for ds, r in ev["datasets"].items()}})
    pts.sort(key=lambda p: p["part4_steps"]["peagle"])
    with open(PART4, "w") as f:
        json.dump(pts, f, indent=1)


def part4_curve() -> list[str]:
    """Per-position acceptance (K=5) vs tokens seen over part 4: table rows and a PNG."""
    if not os.path.isfile(PART4):
        return []
    pts = json.load(open(PART4))
    # tokens seen before part 4 = parts 1-3's steps x 1,024
    before = {h: sum(steps(h)[:3]) * 1024 for h, _ in NAMES}
    rows = ["", "| head | point | tokens seen (M) | dataset | AL@5 | acceptance at position 1 / 2 / 3 / 4 / 5 | "
            "identical |", "|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, ds in zip(axes, ("humaneval", "mtbench")):
        for h, label in NAMES:
            x = [(before[h] + p["part4_steps"][h] * 1024) / 1e6 for p in pts]
            for pos in range(3):
                ax.plot(x, [p["acceptance"][ds][h]["per_pos"][pos] for p in pts], "o-" if h == "peagle" else "s--",
                        label=f"{label} position {pos + 1}")
            for p, xx in zip(pts, x):
                a = p["acceptance"][ds][h]
                rows.append(f"| {label} | {p['label']} | {xx:.2f} | {ds} | {a['al']:.2f} | "
                            + " / ".join(f"{v:.0%}" for v in a["per_pos"]) + f" | {a['identical']} |")
        ax.set_title(ds)
        ax.set_xlabel("training tokens seen (M, rows x 1,024)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out acceptance (K=5)")
    axes[1].legend(fontsize=7)
    out = os.path.join(ROOT, "docs", "training-study", "smollm2", "per_position_vs_tokens.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    rows.append(f"wrote {os.path.relpath(out, ROOT)}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--add-point", nargs=4, metavar=("LABEL", "EVAL_JSON", "EAGLE3_STEPS", "PEAGLE_STEPS"))
    a = ap.parse_args()
    if a.add_point:
        label, ev, e3, pe = a.add_point
        add_point(label, ev, int(e3), int(pe))
    for part in (3, 4):   # AL@7 of the parts' shipped heads, from the c=1 report that shipped them
        fn = PART3.replace("part3", f"part{part}")
        if os.path.isfile(fn):
            for head, v in json.load(open(fn)).items():
                AL[(head, part)] = tuple(v)
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
    print("\n".join(part4_curve()))


if __name__ == "__main__":
    main()
