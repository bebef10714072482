"""The issue's goals, measured: where the time goes per engine step and the acceptance length P-EAGLE would
need to meet them."""
from __future__ import annotations

from .summary import DS_NAMES, GOALS, NAMES, _f, _table


def goals_md(s, res) -> str:
    rows = []
    for g in s["goals"]:
        short = ("" if g["met"] or g["measured"] is None or g["measured"] >= g["target"]
                 else f"missed by {100 * (1 - g['measured'] / g['target']):.0f}%")
        rows.append([g["goal"], _f(g["measured"], 2, "×") + (f" ({g['where']})" if g.get("where") else ""),
                     "met" if g["met"] else ("undecided" if "undecided" in g.get("where", "") else "**not met**"),
                     short])
    out = _table(["goal", "measured", "", "shortfall"], rows) if rows else "(goals need HumanEval at c=1)"
    out += "\n\n" + why_md(s, min(s["cs"])) + "\n\n" + needed_md(s) + "\n\n" + same_k_md(s)
    hi = max((c for c in s["cs"] if c <= 64), default=None)
    if hi and hi != min(s["cs"]):
        out += "\n\n" + why_md(s, hi)
    return out


def why_md(s, c) -> str:
    """Where the time goes at concurrency c: per-step drafter and verification time and acceptance, best K."""
    rows = []
    for ds in s["datasets"]:
        b = s["best"].get((ds, "baseline", c))
        for m in ("eagle3", "peagle"):
            x = s["best"].get((ds, m, c))
            if not x:
                continue
            rows.append([DS_NAMES.get(ds, ds), NAMES[m], x["k"], _f(x["al"]), _f(x["draft_ms"]), _f(x["verify_ms"]),
                         _f(x.get("step_ms")), _f(b and b.get("step_ms")),
                         _f(x["draft_ms"] / x["verify_ms"] if x["draft_ms"] and x["verify_ms"] else None)])
    return (f"Where the time goes at c={c} (each method at its best K; a step drafts K tokens per request and "
            "verifies K+1; engine step = wall time ÷ engine steps, prefill included; ideal speedup over baseline = "
            "AL × baseline step ÷ speculative step):\n\n"
            + _table(["dataset", "method", "K", "AL", "draft ms/step", "verify ms/step", "engine ms/step",
                      "baseline ms/step", "draft ÷ verify"], rows))


def needed_md(s) -> str:
    """The acceptance length P-EAGLE would need, at its measured cost per step, to meet the c=1 goals
    (tokens/s = AL ÷ step time): AL ≥ goal × (rival tokens/s) × P-EAGLE step time."""
    c1, rows = min(s["cs"]), []
    g_e, g_b = GOALS["peagle_vs_eagle3_humaneval_c1"], GOALS["peagle_vs_baseline_humaneval_c1"]
    for ds in s["datasets"]:
        b, e = s["best"].get((ds, "baseline", c1)), s["best"].get((ds, "eagle3", c1))
        for k in s["ks"]:
            p = s["agg"].get((ds, "peagle", k, c1))
            if not p or not p["tok_s"]:
                continue
            step = p["al"] / p["tok_s"]                                    # s per step, measured
            rows.append([DS_NAMES.get(ds, ds), k, _f(1000 * step), _f(p["al"]),
                         _f(g_e * e["tok_s"] * step if e else None), _f(g_b * b["tok_s"] * step if b else None), k + 1])
    return (f"What P-EAGLE's acceptance length would have to be, at its measured step time, for the c={c1} goals "
            f"(P-EAGLE tokens/s = AL ÷ step time; needed AL = goal × rival's tokens/s × step time; a step can "
            "never yield more than K+1 tokens):\n\n"
            + _table(["dataset", "P-EAGLE K", "step ms", "AL measured", f"AL for {g_e}× EAGLE-3 (best K)",
                      f"AL for {g_b}× baseline", "max AL"], rows))


def same_k_md(s) -> str:
    """P-EAGLE ÷ EAGLE-3 at equal K: the drafting-cost effect without the choice of K."""
    rows = []
    for ds in s["datasets"]:
        for c in sorted({min(s["cs"]), max(s["cs"])}):
            row = [DS_NAMES.get(ds, ds), c]
            for k in s["ks"]:
                e, p = s["agg"].get((ds, "eagle3", k, c)), s["agg"].get((ds, "peagle", k, c))
                row.append(f"{_f(p['tok_s'] / e['tok_s'], 2, '×')} ({_f(p['al'])} vs {_f(e['al'])})"
                           if e and p and e["tok_s"] else "–")
            rows.append(row)
    return ("P-EAGLE ÷ EAGLE-3 output tokens/s at the same K (in brackets: acceptance length, P-EAGLE vs EAGLE-3):\n\n"
            + _table(["dataset", "c"] + [f"K={k}" for k in s["ks"]], rows))
