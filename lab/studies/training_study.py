"""The drafter training-recipe study (issue 13): per-depth training accuracy vs training minutes for each run,
and the end-to-end acceptance of the resulting heads.

    python lab/studies/training_study.py --run e3=runs/heads/e3 --run "e3 stage 2=runs/heads/e3b@20" \\
        --eval eval.json --out docs/training-study

``--run NAME=DIR[@MINUTES]``: a ``peagle train`` output directory (its ``train_log.jsonl``); ``@MINUTES`` shifts
its clock by the training the run started from (``--init`` / ``--init-from-eagle3``), so every curve is on the
axis of total training minutes behind the head.  ``--eval``: ``python -m peagle.train.evaluate_heads --out``
JSON files whose head names match the run names.  Training accuracy is the fast proxy (P-EAGLE's is measured
on COD-sampled depths, EAGLE-3's on its test-time-training unroll, so the two methods' curves are not
comparable with each other); the end-to-end acceptance table is the judge.  Writes ``acc_vs_minutes.png`` and
``table.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def read_log(path: Path, offset_min: float) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"min": offset_min + r["time_s"] / 60, "acc": r["acc"], "step": r["step"]} for r in rows if "acc" in r]


def smooth(xs: list[float], w: int = 5) -> list[float]:
    windows = (xs[max(0, i - w + 1):i + 1] for i in range(len(xs)))
    return [sum(x) / len(x) for x in windows]


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), sharey=True, squeeze=False)
    for ax, (name, log) in zip(axes[0], runs.items()):
        depths = len(log[0]["acc"]) if log else 0
        for d in range(depths):
            ax.plot([r["min"] for r in log], smooth([r["acc"][d] for r in log]), label=f"depth {d + 1}",
                    color=plt.cm.viridis(d / max(1, depths - 1)))
        ax.set_title(name)
        ax.set_xlabel("training minutes behind the head")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training accuracy (moving average of 5 logs)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(runs: dict[str, list[dict]], acc_by_ds: dict, speed_by_ds: dict) -> str:
    lines = ["| run | minutes | steps | last training accuracy per depth | dataset | acceptance length (K=7) | "
             "per-position acceptance | greedy identical | tokens/s (batch 1) |", "|---" * 9 + "|"]
    for name, log in runs.items():
        last = log[-1] if log else {"min": 0, "step": 0, "acc": []}
        acc = " / ".join(f"{a:.2f}" for a in last["acc"])
        for ds, heads in acc_by_ds.items():
            h = heads.get(name)
            if h is None:
                continue
            pos = " / ".join(f"{p:.2f}" for p in h["acceptance_per_pos"])
            tps = speed_by_ds.get(ds, {}).get(name)
            lines.append(f"| {name} | {last['min']:.0f} | {last['step']} | {acc} | {ds} | "
                         f"{h['acceptance_length']:.3f} | {pos} | {'yes' if h['identical'] else 'NO'} | "
                         f"{tps if tps is not None else '–'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python lab/studies/training_study.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="NAME=DIR[@MINUTES]")
    ap.add_argument("--eval", action="append", default=[], help="evaluate_heads --out JSON")
    ap.add_argument("--out", default="build/training-study")
    a = ap.parse_args(argv)
    runs = {}
    for spec in a.run:
        name, _, rest = spec.partition("=")
        path, _, off = rest.partition("@")
        log = Path(path) / "train_log.jsonl"
        if not log.is_file():
            raise SystemExit(f"error: {log} not found (a peagle train output directory is expected)")
        runs[name] = read_log(log, float(off or 0))
    acc_by_ds: dict = {}      # dataset -> head name -> evaluate_heads' acceptance record
    speed_by_ds: dict = {}    # dataset -> head name (or "plain") -> batch-1 tokens/s
    for f in a.eval:
        for ds, d in json.loads(Path(f).read_text()).get("datasets", {}).items():
            acc_by_ds.setdefault(ds, {}).update({k: v for k, v in d.items()
                                                 if isinstance(v, dict) and "acceptance_length" in v})
            speed_by_ds.setdefault(ds, {}).update(d.get("batch1_tok_s", {}))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "acc_vs_minutes.png")
    cmd = "python lab/studies/training_study.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    (out / "table.md").write_text(f"`{cmd}`\n\n{table(runs, acc_by_ds, speed_by_ds)}\n")
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
