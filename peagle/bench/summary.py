"""A results.json summarised: median figures per (dataset, method, K, c), best K, speedups, goals; and the
Markdown helpers the report pages share."""
from __future__ import annotations

import statistics

NAMES = {"baseline": "baseline", "eagle3": "EAGLE-3", "peagle": "P-EAGLE", "hf": "HF generate",
         "hf-pld": "HF prompt lookup"}
DS_NAMES = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "speed": "SPEED-style mix"}
GOALS = {"peagle_vs_eagle3_humaneval_c1": 1.5, "peagle_vs_baseline_humaneval_c1": 3.0,
         "peagle_vs_eagle3_min_upto_c64": 1.0, "auto_vs_best": 0.95, "auto_vs_baseline": 1.0}
AUTO = "auto"


def korder(k):
    """Sort key for K values: integers ascending, then "auto"."""
    return (1, 0) if k == AUTO else (0, k)


def percentile(xs, q):
    """The q-th percentile of xs (nearest rank on the sorted values, no interpolation); None for none."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _baseline_points(runs) -> dict:
    """(dataset, c, repeat) -> its baseline runs' (t_mid, tokens/s), in time order (runs that record t_mid)."""
    by: dict = {}
    for r in runs:
        if r["method"] == "baseline" and r.get("t_mid") is not None and r["output_tok_s"]:
            by.setdefault((r["dataset"], r["concurrency"], r.get("repeat", 0)), []).append((r["t_mid"], r["output_tok_s"]))
    return {k: sorted(v) for k, v in by.items()}


def paced(runs) -> dict:
    """id(run) -> its tokens/s at the baseline's pace: the run's tokens/s divided by the baseline's at the run's
    time (linear between the baseline runs of its dataset, concurrency and repeat that bracket its midpoint
    t_mid; the nearest one past either end), times the median of every baseline run of its dataset and
    concurrency. A machine whose speed drifts during a sweep slows a run and the baselines around it alike, so
    ratios of these figures compare methods as if they had run at the same moment. Runs without t_mid (online
    runs, sweeps before it was recorded) and baseline runs keep their own tokens/s."""
    base = _baseline_points(runs)
    pooled: dict = {}
    for (ds, c, _), pts in base.items():
        pooled.setdefault((ds, c), []).extend(v for _, v in pts)
    median = {k: statistics.median(v) for k, v in pooled.items()}
    out = {}
    for r in runs:
        pts = base.get((r["dataset"], r["concurrency"], r.get("repeat", 0)), [])
        t = r.get("t_mid")
        if r["method"] == "baseline" or t is None or not pts or not r["output_tok_s"]:
            out[id(r)] = r["output_tok_s"]
            continue
        before = [p for p in pts if p[0] <= t]
        after = [p for p in pts if p[0] > t]
        if before and after:
            (t0, v0), (t1, v1) = before[-1], after[0]
            here = v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        else:
            here = (before[-1] if before else after[0])[1]
        out[id(r)] = r["output_tok_s"] / here * median[(r["dataset"], r["concurrency"])]
    return out


def baseline_noise(runs) -> dict:
    """(dataset, c) -> the median relative difference between baseline runs adjacent in time (the same command
    seconds apart, in one repeat): how far apart two runs of one setting land on this machine; ratios closer to
    1 than that are within its noise. Only sweeps that record t_mid, with two baseline runs in a repeat."""
    diffs: dict = {}
    for (ds, c, _), pts in _baseline_points(runs).items():
        diffs.setdefault((ds, c), []).extend(abs(b / a - 1) for (_, a), (_, b) in zip(pts, pts[1:]))
    return {k: statistics.median(v) for k, v in diffs.items() if v}


def aggregate(runs) -> dict:
    """(dataset, method, k, c) -> median figures over repeats; tok_s at the baseline's pace (paced), tok_s_raw
    as measured."""
    pace = paced(runs)
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["method"], r["k"], r["concurrency"]), []).append(r)
    agg = {}
    for key, rs in groups.items():
        m = rs[0]["metrics"]
        agg[key] = {"tok_s": _med([pace[id(r)] for r in rs]), "tok_s_raw": _med([r["output_tok_s"] for r in rs]),
                    "n_repeats": len(rs),
                    "ttft_ms": _med([r["ttft_ms"]["mean"] for r in rs]), "tpot_ms": _med([r["tpot_ms"]["mean"] for r in rs]),
                    "al": m["mean_acceptance_length"], "per_pos": m["acceptance_rate_per_pos"],
                    "draft_ms": _med([r.get("timing", {}).get("draft_ms_per_step") for r in rs]),
                    "verify_ms": _med([r.get("timing", {}).get("verify_ms_per_step") for r in rs]),
                    "step_ms": _med([1000 * r["wall_s"] / r["timing"]["n_steps"] for r in rs
                                     if r.get("timing", {}).get("n_steps")]),
                    "mean_k": _med([r.get("mean_k") for r in rs]),
                    "identical": sum(r["identity"].get("identical", 0) for r in rs),
                    "n": sum(r["identity"].get("n", 0) for r in rs),
                    "ties": sum(len(r["identity"].get("ties", [])) for r in rs),
                    "mismatches": sum(len(r["identity"].get("mismatches", [])) for r in rs)}
    return agg


def main_runs(res) -> list:
    """The runs the report is about: offline ones, or the online ones of an online-only sweep."""
    return res["runs"] or res.get("online_runs", [])


def summarize(res, runs=None) -> dict:
    agg = aggregate(main_runs(res) if runs is None else runs)
    dss = list(res["datasets"])
    cs = sorted({k[3] for k in agg})
    ks = sorted({k[2] for k in agg if k[1] != "baseline" and k[2] != AUTO})       # static K values
    best, speed, auto = {}, {}, {}
    for ds in dss:
        for c in cs:
            for m in ("baseline", "eagle3", "peagle"):
                cands = [(v["tok_s"], k[2]) for k, v in agg.items() if k[0] == ds and k[1] == m and k[3] == c
                         and k[2] != AUTO]
                if cands:
                    t, k = max(cands)
                    best[(ds, m, c)] = {"k": k, **agg[(ds, m, k, c)]}
                if (ds, m, AUTO, c) in agg:
                    auto[(ds, m, c)] = {"k": AUTO, **agg[(ds, m, AUTO, c)]}
            b, e, p = (best.get((ds, m, c)) for m in ("baseline", "eagle3", "peagle"))
            speed[(ds, c)] = {"peagle_vs_eagle3": p["tok_s"] / e["tok_s"] if p and e else None,
                              "peagle_vs_baseline": p["tok_s"] / b["tok_s"] if p and b else None,
                              "eagle3_vs_baseline": e["tok_s"] / b["tok_s"] if e and b else None}
            for m, x in (("eagle3", e), ("peagle", p)):
                a = auto.get((ds, m, c))
                ref = max([y["tok_s"] for y in (x, b) if y], default=None)
                speed[(ds, c)][f"{m}_auto_vs_best"] = a["tok_s"] / ref if a and ref else None
                speed[(ds, c)][f"{m}_auto_vs_baseline"] = a["tok_s"] / b["tok_s"] if a and b else None
    goals = []
    he = "humaneval" if "humaneval" in dss else None
    c1 = min(cs) if cs else None
    if he and c1 == 1:
        for key, name in (("peagle_vs_eagle3", "P-EAGLE ÷ EAGLE-3, HumanEval, c=1"),
                          ("peagle_vs_baseline", "P-EAGLE ÷ baseline, HumanEval, c=1")):
            v, g = speed[(he, 1)][key], GOALS[f"{key}_humaneval_c1"]
            goals.append({"goal": f"{name} ≥ {g}", "measured": v, "target": g, "met": v is not None and v >= g})
    low = [(speed[(ds, c)]["peagle_vs_eagle3"], ds, c) for ds in dss for c in cs
           if c <= 64 and speed[(ds, c)]["peagle_vs_eagle3"] is not None]
    if low:
        v, ds, c = min(low)
        part = max(c for c in cs if c <= 64) < 64
        goals.append({"goal": "P-EAGLE never slower than EAGLE-3 up to c=64 (min ratio ≥ 1.0)", "measured": v,
                      "target": 1.0, "met": v >= 1.0 and not part,
                      "where": f"{DS_NAMES.get(ds, ds)}, c={c}" + (f"; only c ≤ {max(cs)} measured: undecided"
                                                                    if part else "")})
    for m in ("eagle3", "peagle"):
        for key, g, what in (("auto_vs_best", GOALS["auto_vs_best"], "max(best static K, baseline)"),
                             ("auto_vs_baseline", GOALS["auto_vs_baseline"], "baseline")):
            vals = [(speed[(ds, c)][f"{m}_{key}"], ds, c) for ds in dss for c in cs
                    if speed[(ds, c)][f"{m}_{key}"] is not None]
            if vals:
                v, ds, c = min(vals)
                goals.append({"goal": f"{NAMES[m]} auto ≥ {g} × {what} at every concurrency", "measured": v,
                              "target": g, "met": v >= g, "where": f"minimum: {DS_NAMES.get(ds, ds)}, c={c}"})
    return {"agg": agg, "best": best, "auto": auto, "speed": speed, "goals": goals, "datasets": dss, "cs": cs,
            "ks": ks}


def _f(x, nd=2, suf=""):
    return "–" if x is None else f"{x:.{nd}f}{suf}"


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
