"""The report's K "auto" section: auto against the best static K (and baseline) of the same head at every
concurrency, and the K it chose (mean over decode steps)."""
from __future__ import annotations

from .summary import DS_NAMES, GOALS, NAMES, _f, _table


def auto_md(s) -> str:
    if not s.get("auto"):
        return ""
    parts = []
    for m in ("eagle3", "peagle"):
        if not any(k[1] == m for k in s["auto"]):
            continue
        rows = [[DS_NAMES.get(ds, ds)] + [_f(s["speed"][(ds, c)][f"{m}_auto_vs_best"], 2, "×") for c in s["cs"]]
                for ds in s["datasets"]]
        parts.append(f"**{NAMES[m]} auto ÷ max(best static K, baseline)** (goal ≥ {GOALS['auto_vs_best']}; "
                     f"auto ÷ baseline goal ≥ {GOALS['auto_vs_baseline']})\n\n"
                     + _table(["Benchmark"] + [f"c={c}" for c in s["cs"]], rows))
        rows = []
        for ds in s["datasets"]:
            for c in s["cs"]:
                a, x, b = s["auto"].get((ds, m, c)), s["best"].get((ds, m, c)), s["best"].get((ds, "baseline", c))
                if not a:
                    continue
                sp = s["speed"][(ds, c)]
                rows.append([DS_NAMES.get(ds, ds), c, _f(b and b["tok_s"], 1),
                             f"{_f(x and x['tok_s'], 1)} (K={x['k'] if x else '–'})", _f(a["tok_s"], 1),
                             _f(a.get("mean_k"), 2), _f(a["al"]), _f(sp[f"{m}_auto_vs_best"], 2, "×"),
                             _f(sp[f"{m}_auto_vs_baseline"], 2, "×")])
        parts.append(_table(["dataset", "c", "baseline tok/s", f"{NAMES[m]} best static", "auto tok/s",
                             "auto mean K", "auto AL", "÷ max(best, baseline)", "÷ baseline"], rows))
    return ("K chosen per step (`\"num_speculative_tokens\": \"auto\"`, up to the head's trained depth): each "
            "step takes the K with the most expected tokens per second from the live acceptance and the measured "
            "step-cost model (K = 0: a plain step). Mean K = K averaged over decode steps.\n\n" + "\n\n".join(parts))
