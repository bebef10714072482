"""The demo-target recipe study (issue 12): held-out loss per CPU-minute for several shapes.

    python lab/studies/target_study.py RUN_DIR [RUN_DIR ...] --data-dir data/target --speed speed.json \
        --out docs/target-study

Each RUN_DIR is a ``python -m lab.demo_target.train --run-dir RUN_DIR --log-json RUN_DIR/log.jsonl`` run.
For every run it evaluates the last checkpoint's held-out code and chat loss (``--eval-rows`` rows of 512
tokens per source) and reads the training-loss curve from ``log.jsonl``.  Runs that shared the machine
with other jobs have meaningless wall times, so CPU-minutes are computed as tokens ÷ the shape's
tokens/s from ``--speed`` (the JSON written by ``lab/studies/target_train_speed.py --json``, measured side by
side on a quiet machine).  Writes ``study.md`` (table) and ``loss_vs_tokens.png`` /
``loss_vs_cpu_minutes.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def shape_name(cfg: dict) -> str:
    return f"{cfg['num_hidden_layers']}x{cfg['hidden_size']}"


def evaluate(run_dir: Path, data_dir: Path, rows: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lab.demo_target.tokens import SOURCES, eval_loss, heldout_rows, load_tokens

    st = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    cfg = LlamaConfig(**{k: v for k, v in st["config"].items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(st["model"])
    seq = st["args"]["seq_len"]
    out = {"run": run_dir.name, "shape": shape_name(st["config"]), "step": st["step"],
           "tokens": st["step"] * st["args"]["batch_size"] * seq, "lr": st["args"]["lr"],
           "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2)}
    for s in SOURCES:
        out[f"{s}_loss"] = round(eval_loss(model, heldout_rows(load_tokens(data_dir / "tokens" / f"{s}.heldout.bin"),
                                                               rows, seq), torch.device("cpu")), 4)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--data-dir", default="data/target")
    ap.add_argument("--speed", required=True, help="JSON {shape: tokens/s} from lab/studies/target_train_speed.py --json")
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--out", default="build/target-study")
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = json.loads(Path(a.speed).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res, curves = [], {}
    for r in map(Path, a.runs):
        ev = evaluate(r, Path(a.data_dir), a.eval_rows)
        ev["tok_s"] = speed.get(ev["shape"])
        ev["cpu_min"] = round(ev["tokens"] / ev["tok_s"] / 60, 1) if ev["tok_s"] else None
        res.append(ev)
        log = [json.loads(x) for x in (r / "log.jsonl").read_text().splitlines() if x.strip()] \
            if (r / "log.jsonl").exists() else []
        curves[ev["run"]] = (np.array([x["tokens"] for x in log]), np.array([x["loss_ema"] for x in log]), ev["tok_s"])
    for xkey, fname, label in (("tokens", "loss_vs_tokens.png", "training tokens (M)"),
                               ("cpu", "loss_vs_cpu_minutes.png", "CPU-minutes on 2 threads (tokens / measured tok/s)")):
        plt.figure(figsize=(6.4, 4))
        for name, (tok, loss, tps) in curves.items():
            if len(tok) and (xkey == "tokens" or tps):
                plt.plot(tok / 1e6 if xkey == "tokens" else tok / tps / 60, loss, label=name)
        plt.xlabel(label)
        plt.ylabel("training loss (EMA, nats/token)")
        plt.legend()
        plt.grid(alpha=0.3)
        plt.tight_layout()
        plt.savefig(out / fname, dpi=110)
        plt.close()
    cmd = "python lab/studies/target_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"`{cmd}`", "", "| run | shape | params (M) | lr | steps | tokens (M) | tok/s (2 thr) | CPU-min | "
             "held-out code loss | held-out chat loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in res:
        lines.append(f"| {e['run']} | {e['shape']} | {e['params_m']} | {e['lr']} | {e['step']} | "
                     f"{e['tokens'] / 1e6:.2f} | {e['tok_s'] or '-'} | {e['cpu_min'] or '-'} | {e['code_loss']} | "
                     f"{e['chat_loss']} |")
    (out / "study.md").write_text("\n".join(lines) + "\n")
    (out / "study.json").write_text(json.dumps(res, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
