"""Per-step trace of "auto": why each K was chosen and how the step turned out, as JSON lines.

Switched on by AutoKConfig(trace=PATH or an open text file) -- the speculative config's "auto_k": {"trace":
PATH} -- or, for every AutoK a process builds (LLM, serve, bench), by the environment variable
PEAGLE_AUTOK_TRACE=PATH (AutoKConfig.with_env). Lines are appended (several runs may share a file: each
record carries its run id); the first line of a run is {"event": "start", ...} (K max, cost model, guard
settings), then one {"event": "step", ...} per decode step:

  run, step, batch_size, k (used), k_model (what the cost x acceptance model chose, before the guard),
  forced (why the guard made it K = 0: "fallback" / "plain_refresh", else null), catch_up_rows,
  pred_step_s (the cost model's seconds for this K, plus the full catch-up), step_s (measured),
  pred_tokens (sum over rows of E[accepted + 1 | K]), tokens (realised), plain_step_s (the guard's plain
  reference at this batch size), per_k (per K: predicted seconds and expected tokens, when the model was asked),
  alpha (acceptance estimate per draft position), guard (what the guard did after the step, if anything).

Invariant: tracing only records; it never changes a decision (a run with and without it chooses the same K).
`summarize(path)` (or `python -m peagle.autok.trace FILE`) condenses a trace: per K, steps, mean measured /
predicted seconds and realised / predicted tokens; the guard's fallbacks; realised tokens/s against the plain
reference."""
from __future__ import annotations

import itertools
import json
import os
import sys
import weakref

ENV = "PEAGLE_AUTOK_TRACE"
_runs = itertools.count()


class Trace:
    def __init__(self, dest, header: dict):
        """dest: a path (appended to, line-buffered) or an open text file (not closed here)."""
        self.own = isinstance(dest, (str, os.PathLike))
        if self.own:
            os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        self.f = open(dest, "a", buffering=1) if self.own else dest
        if self.own:                                  # closed with the policy (a sweep builds many)
            weakref.finalize(self, self.f.close)
        self.run = f"{os.getpid()}-{next(_runs)}"
        self.write({"event": "start", **header})

    def write(self, rec: dict):
        self.f.write(json.dumps({"run": self.run, **rec}, default=_plain) + "\n")

    def close(self):
        if self.own and not self.f.closed:
            self.f.close()


def open_trace(dest, header: dict) -> Trace | None:
    """dest: a path or an open text file; None, False or "": no trace."""
    if dest is None or dest is False or dest == "":
        return None
    return Trace(dest, header)


def _plain(x):
    """numpy scalars and arrays -> JSON numbers / lists."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def r6(x):
    """Round floats (and lists of them) to 6 significant digits for the trace."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [r6(v) for v in x]
    return float(f"{float(x):.6g}") if isinstance(x, float) else x


def read(path) -> list:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def summarize(records) -> dict:
    """records: a trace's parsed lines (or its path). Per run: steps; per K: steps, measured / predicted step
    time, realised / predicted tokens (means of the ratios); guard: fallbacks, forced steps; realised tokens/s
    of the run and of plain decoding at the guard's reference (same batch sizes and tokens)."""
    if isinstance(records, (str, os.PathLike)):
        records = read(records)
    out: dict = {}
    for rec in records:
        if rec.get("event") != "step":
            continue
        run = out.setdefault(rec["run"], {"steps": 0, "per_k": {}, "fallbacks": 0, "forced": {}, "seconds": 0.0,
                                          "tokens": 0, "plain_seconds": 0.0})
        run["steps"] += 1
        k = str(rec["k"])
        pk = run["per_k"].setdefault(k, {"steps": 0, "time_ratio": 0.0, "token_ratio": 0.0})
        pk["steps"] += 1
        pk["time_ratio"] += rec["step_s"] / max(rec["pred_step_s"], 1e-12)
        pk["token_ratio"] += rec["tokens"] / max(rec["pred_tokens"], 1e-12)
        if rec.get("forced"):
            run["forced"][rec["forced"]] = run["forced"].get(rec["forced"], 0) + 1
        if (rec.get("guard") or {}).get("verdict") == "failed":
            run["fallbacks"] += 1
        run["seconds"] += rec["step_s"]
        run["tokens"] += rec["tokens"]
        if rec.get("plain_step_s"):
            run["plain_seconds"] += rec["tokens"] / rec["batch_size"] * rec["plain_step_s"]
    for run in out.values():
        for pk in run["per_k"].values():
            pk["time_ratio"] = round(pk["time_ratio"] / pk["steps"], 4)
            pk["token_ratio"] = round(pk["token_ratio"] / pk["steps"], 4)
        run["per_k"] = dict(sorted(run["per_k"].items(), key=lambda kv: int(kv[0])))
        run["tokens_per_s"] = round(run["tokens"] / max(run["seconds"], 1e-12), 2)
        if run["plain_seconds"]:
            run["plain_tokens_per_s"] = round(run["tokens"] / run["plain_seconds"], 2)
            run["vs_plain"] = round(run["plain_seconds"] / max(run["seconds"], 1e-12), 4)
        run["seconds"], run["plain_seconds"] = round(run["seconds"], 4), round(run["plain_seconds"], 4)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m peagle.autok.trace TRACE.jsonl   (summarises an auto-K trace file)"
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    try:
        print(json.dumps(summarize(argv[0]), indent=1))
    except (OSError, ValueError) as e:
        print(f"peagle: error: {argv[0]}: not a readable trace ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
