"""The Markdown report of a results.json (and its plots)."""
from __future__ import annotations

import json
import os
import statistics

from ..errors import PeagleError
from .autok_report import auto_md
from .goals import goals_md
from .plots import write_plots
from .summary import DS_NAMES, NAMES, _f, _med, _table, baseline_noise, korder, main_runs, paced, summarize


def headline(s) -> str:
    """The seeds' layout: one row per dataset, one column per concurrency, each cell a ratio at best K."""
    parts = []
    for key, title in (("peagle_vs_eagle3", "P-EAGLE ÷ EAGLE-3"), ("peagle_vs_baseline", "P-EAGLE ÷ baseline"),
                       ("eagle3_vs_baseline", "EAGLE-3 ÷ baseline")):
        rows = [[DS_NAMES.get(ds, ds)] + [_f(s["speed"][(ds, c)][key], 2, "×") for c in s["cs"]] for ds in s["datasets"]]
        parts.append(f"**{title}** (output tokens/s, each method at its best K)\n\n"
                     + _table(["Benchmark"] + [f"c={c}" for c in s["cs"]], rows))
    return "\n\n".join(parts)


def dataset_md(s, ds) -> str:
    rows = []
    for c in s["cs"]:
        b, e, p = (s["best"].get((ds, m, c)) for m in ("baseline", "eagle3", "peagle"))
        sp = s["speed"][(ds, c)]

        def cell(x):
            return "–" if not x else f"{x['tok_s']:.1f} (K={x['k']}, AL {x['al']:.2f})"
        rows.append([c, _f(b and b["tok_s"], 1), cell(e), cell(p), _f(sp["peagle_vs_eagle3"], 2, "×"),
                     _f(sp["peagle_vs_baseline"], 2, "×"), _f(sp["eagle3_vs_baseline"], 2, "×"),
                     " / ".join(_f(x and x["ttft_ms"], 0) for x in (b, e, p)),
                     " / ".join(_f(x and x["tpot_ms"], 1) for x in (b, e, p))])
    return _table(["c", "baseline tok/s", "EAGLE-3 best", "P-EAGLE best", "P ÷ E", "P ÷ base", "E ÷ base",
                   "TTFT ms (b/E/P)", "TPOT ms (b/E/P)"], rows)


def acceptance_md(s) -> str:
    c1 = min(s["cs"])
    rows = []
    for m in ("peagle", "eagle3"):
        for k in s["ks"]:
            vals = [s["agg"].get((ds, m, k, c1)) for ds in s["datasets"]]
            if any(vals):
                rows.append([f"{NAMES[m]} K={k}"] + [_f(v and v["al"]) for v in vals])
    al = _table(["mean acceptance length"] + [DS_NAMES.get(d, d) for d in s["datasets"]], rows)
    pp = []
    for ds in s["datasets"]:
        rows = []
        for m in ("eagle3", "peagle"):
            for k in s["ks"]:
                v = s["agg"].get((ds, m, k, c1))
                if v:
                    rows.append([f"{NAMES[m]} K={k}"] + [f"{100 * x:.0f}%" for x in v["per_pos"]])
        if rows:
            kmax = max(s["ks"])
            pp.append(f"*{DS_NAMES.get(ds, ds)}*\n\n" + _table(["per-position acceptance"] + [str(i + 1) for i in range(kmax)],
                                                          [r + [""] * (kmax + 1 - len(r)) for r in rows]))
    return al + "\n\n" + "\n\n".join(pp)


def _name(run: dict) -> str:
    """A run's display name (tree runs carry their own label, e.g. peagle+tree4x8)."""
    return NAMES.get(run["method"], run["method"])


def category_md(res, s) -> str:
    """Acceptance length per prompt category at c=1 (SPEED-Bench reports per category)."""
    c1 = min(s["cs"])
    out = []
    for ds, info in res["datasets"].items():
        cats = info.get("categories_per_prompt") or []
        if len(set(cats)) < 2:
            continue
        runs = [r for r in main_runs(res) if r["dataset"] == ds and r["concurrency"] == c1 and r.get("repeat", 0) == 0
                and r["method"] != "baseline"]
        runs = [r for r in runs if r["requests"] and "num_drafts" in r["requests"][0]]    # offline only
        runs.sort(key=lambda r: (r["method"], korder(r["k"])))
        rows = []
        for cat in dict.fromkeys(cats):
            row = [cat]
            for r in runs:
                rq = [q for q in r["requests"] if cats[q["id"] % len(cats)] == cat]
                d = sum(q["num_drafts"] for q in rq)
                row.append(_f(1 + sum(q["num_accepted"] for q in rq) / d if d else None))
            rows.append(row)
        out.append(f"*{DS_NAMES.get(ds, ds)}*\n\n" + _table(["category"] + [f"{_name(r)} K={r['k']}" for r in runs],
                                                          rows))
    return "\n\n".join(out)


def drafter_md(s) -> str:
    c1 = min(s["cs"])
    rows = []
    for k in s["ks"]:
        row = [k]
        for m in ("eagle3", "peagle"):
            v = [s["agg"].get((ds, m, k, c1)) for ds in s["datasets"]]
            v = [x for x in v if x]
            row += [_f(_med([x["draft_ms"] for x in v])), _f(_med([x["verify_ms"] for x in v]))]
        rows.append(row)
    return _table(["K", "EAGLE-3 draft ms/step", "EAGLE-3 verify ms/step", "P-EAGLE draft ms/step",
                   "P-EAGLE verify ms/step"], rows)


def _fmean(xs):
    return statistics.fmean(xs) if xs else None


def _subset(r, n):
    """A c=1 run's figures over its first n requests (sequential at c=1: tokens ÷ summed latency)."""
    rq = r["requests"][:n]
    tot, t = sum(q["output_len"] for q in rq), sum(q["e2e_s"] for q in rq)
    return {"method": r["method"], "k": r["k"], "n_requests": len(rq), "output_tok_s": tot / t if t else None,
            "ttft_ms": {"mean": 1000 * statistics.fmean(q["ttft_s"] for q in rq)},
            "tpot_ms": {"mean": _fmean([1000 * q["tpot_s"] for q in rq if q["tpot_s"] is not None])},   # as peers'
            "identity": {"identical": "reference", "n": len(rq)}
            if r["method"] == "baseline" else {"identical": sum(1 for i in range(len(rq)) if i not in {
                x["request"] for x in r["identity"].get("ties", []) + r["identity"].get("mismatches", [])}),
                "n": len(rq)}}


def peers_md(res) -> str:
    if not res.get("peers"):
        return "(no peers run)"
    rows = []
    for ds in res["datasets"]:
        ps = [r for r in res["peers"] if r["dataset"] == ds and not r.get("subset")]
        if not ps:
            continue
        n = ps[0]["n_requests"]
        c1 = [r for r in res["runs"] if r["dataset"] == ds and r["concurrency"] == 1 and r.get("repeat", 0) == 0]
        sub = {(r["method"], r["k"]): _subset(r, n) for r in c1}
        base = sub.get(("baseline", 0))
        best = {m: max((r for (mm, _), r in sub.items() if mm == m), key=lambda r: r["output_tok_s"] or 0,
                       default=None) for m in ("eagle3", "peagle")}
        for r in ps + [base, best["eagle3"], best["peagle"]]:
            if r is None:
                continue
            name = NAMES.get(r["method"], r["method"]) + (f" (K={r['k']})" if r["method"] in ("eagle3", "peagle") else "")
            if r["method"] in ("baseline", "eagle3", "peagle"):
                name = "peagle " + name
            if r["method"] == "hf-pld":
                name += f" (prompt_lookup_num_tokens={r['k']})"
            idt = r.get("identity", {})
            rows.append([DS_NAMES.get(ds, ds), name, r["n_requests"], _f(r["output_tok_s"], 1),
                         _f(r["output_tok_s"] / base["output_tok_s"] if base and r["output_tok_s"] else None, 2, "×"),
                         _f(r["ttft_ms"]["mean"], 0), _f(r["tpot_ms"]["mean"], 1),
                         f"{idt.get('identical', '–')}/{idt.get('n', '–')}" if idt else "–"])
    return ("Same prompts (the first of each dataset), one at a time; peagle's figures are its c=1 run's over "
            "those prompts.\n\n" + _table(["dataset", "engine", "prompts", "tok/s", "÷ peagle baseline", "TTFT ms",
                                           "TPOT ms", "same tokens as peagle baseline"], rows))


def identity_md(res, runs=None) -> str:
    rows = []
    for r in main_runs(res) if runs is None else runs:
        if r["method"] == "baseline":
            continue
        i = r["identity"]
        if i.get("ok") is None:
            continue
        rows.append((r["dataset"], r["method"], r["k"], r["concurrency"], i["identical"], i["n"], len(i["ties"]),
                     len(i["mismatches"])))
    if not rows:
        return "(sampling run: no greedy identity check)"
    n = sum(r[5] for r in rows)
    same = sum(r[4] for r in rows)
    ties = sum(r[6] for r in rows)
    bad = sum(r[7] for r in rows)
    head = (f"Greedy outputs of every speculative run compared token for token with baseline's at the same "
            f"concurrency: **{same}/{n} identical**, {ties} divergences at floating-point ties (target top-2 "
            f"logits within 1e-4), **{bad} real mismatches**.")
    bad_rows = [r for r in rows if r[6] or r[7]]
    if bad_rows:
        head += "\n\n" + _table(["dataset", "method", "K", "c", "identical", "n", "ties", "mismatches"], bad_rows)
    return head


def online_md(res) -> str:
    """The online (through `peagle serve`) sweep next to the offline one, in the per-dataset layout."""
    runs = res["online_runs"]
    s = summarize(res, runs)
    head = (f"Every (method, K) served by its own `peagle serve` subprocess; c streaming `openai` clients; "
            f"{len(runs)} runs, {sum(len(r.get('errors', [])) for r in runs)} request errors. "
            + identity_md(res, runs))
    return "\n\n".join([head] + [f"### {DS_NAMES.get(ds, ds)} (online)\n\n" + dataset_md(s, ds) for ds in s["datasets"]])


def runs_md(res) -> str:
    rows = []
    runs = main_runs(res)
    pace = paced(runs)
    for r in runs:
        m, t = r["metrics"], r.get("timing", {})
        rows.append([r["dataset"], r["method"], r["k"], r["concurrency"], r.get("repeat", 0), r["n_requests"],
                     r["output_tokens"], _f(r["wall_s"], 1), _f(r["output_tok_s"], 1), _f(pace[id(r)], 1),
                     _f(r["ttft_ms"]["mean"], 0),
                     _f(r["tpot_ms"]["mean"], 1), _f(m["mean_acceptance_length"]), _f(t.get("draft_ms_per_step")),
                     _f(t.get("verify_ms_per_step")), f"{r['identity'].get('identical', '–')}/{r['identity'].get('n', '–')}"])
    return _table(["dataset", "method", "K", "c", "rep", "reqs", "out tok", "wall s", "tok/s", "paced tok/s", "TTFT ms",
                   "TPOT ms",
                   "AL", "draft ms/step", "verify ms/step", "same"], rows)


def pace_md(res) -> str:
    """How the report's tokens/s are paced (summary.paced), or that they are raw medians."""
    st = res["meta"]["settings"]
    if not any(r.get("t_mid") is not None for r in res["runs"]):
        return "Tokens/s are medians over repeats as measured (the runs carry no times to pace them by).\n"
    every = st.get("ref_every") or 0
    when = f"first, after every {every} runs and last" if every else "first"
    noise = baseline_noise(res["runs"])
    c1 = min((c for _, c in noise), default=None)
    said = [f"{100 * v:.1f} % ({DS_NAMES.get(ds, ds)})" for (ds, c), v in noise.items() if c == c1]
    return ("Tokens/s are at the baseline's pace: each run's tokens/s ÷ the baseline's at the run's time "
            f"(interpolated between the baseline runs of its repeat, which runs {when}) × the baseline's median, "
            "then the median over repeats, so the machine's drift during the sweep cancels in every ratio; the "
            "runs' own figures are in the last table."
            + (f" Baseline runs adjacent in time (the same command seconds apart) differed by a median of "
               f"{', '.join(said)} at c={c1}: a ratio closer to 1 than that is within this machine's noise."
               if said else "") + "\n")


def report_md(res, pngs, notes: str | None = None) -> str:
    s = summarize(res)
    meta = res["meta"]
    mc, v = meta["machine"], meta["versions"]
    st = meta["settings"]
    lines = ["# peagle benchmark: baseline vs EAGLE-3 vs P-EAGLE\n"
             + ("\n**PARTIAL RESULTS: the run was still going (or was cut short) when this was written.**\n"
                if res.get("partial") else ""),
             f"Regenerate every figure below with:\n\n```\n{meta['command']}\n```\n",
             f"Run {meta['started_utc']} → {meta.get('finished_utc')} ({_f(meta.get('duration_s', 0) / 60, 1)} min) on "
             f"{mc['cpu']} ({mc['cores']} cores, {mc['torch_threads']} torch threads, {mc['mem_gib']} GiB; load average at "
             f"start {mc.get('loadavg_at_start')}). Python {v['python']}, torch {v['torch']}, transformers "
             f"{v['transformers']}, peagle {str(v['peagle_commit'])[:10] if v.get('peagle_commit') else v.get('peagle_version')}"
             f"{' (dirty)' if v['peagle_dirty'] else ''}.\n",
             f"Target `{os.path.basename(meta['model'])}`; heads: "
             + ", ".join(f"{NAMES[m]} `{os.path.basename(d) if d else '–'}` {meta.get('head_configs', {}).get(m, '')}"
                         for m, d in meta["heads"].items() if d) + ".\n",
             f"Settings: temperature {st['temperature']}"
             + (" (drafts sampled from the drafter's q)" if st.get("draft_sampling") == "sample"
                and st["temperature"] > 0 else "")
             + f", output length {st['output_len']} "
             f"({'ignore EOS' if st['ignore_eos'] else 'stops at EOS'}), K ∈ {st['ks']}, concurrency {st['concurrency']}, "
             f"repeats {st['repeats']}, prompts per dataset: "
             + ", ".join(f"{DS_NAMES.get(d, d)} {x['n_prompts']}" for d, x in res["datasets"].items())
             + (". Offline through peagle's engine" if res["runs"] else ". Online through `peagle serve`")
             + ", at most c requests in flight; output tokens/s = all output "
               "tokens ÷ wall time; TTFT/TPOT are per-request means; acceptance length = 1 + accepted ÷ drafts "
               "(vLLM's definition).\n",
             pace_md(res),
             "## Headline\n", headline(s),
             *(["\n## Choosing K per step (auto)\n", auto_md(s)] if s.get("auto") else []),
             "\n## Goals\n", goals_md(s, res),
             *(["\n## Analysis\n", notes.strip(), ""] if notes else []),
             "\n## Losslessness\n", identity_md(res), "\n## Per dataset (best K per method and concurrency)\n"]
    for ds in s["datasets"]:
        lines += [f"### {DS_NAMES.get(ds, ds)}\n", dataset_md(s, ds), ""]
    lines += [f"## Acceptance (c={min(s['cs'])})\n", acceptance_md(s),
              f"\n## Acceptance length per category (c={min(s['cs'])})\n", category_md(res, s),
              f"\n## Drafter vs verification time per step (c={min(s['cs'])}, median over datasets)\n", drafter_md(s),
              "\n## External peers (c=1, HF transformers on the same weights)\n", peers_md(res)]
    if res["runs"] and res.get("online_runs"):
        lines += ["\n## Online: through the server (best K per method)\n", online_md(res)]
    lines += ["\n## Plots\n"]
    lines += [f"![{p}]({p})" for p in pngs]
    lines += ["\n## Datasets\n"]
    for ds, x in res["datasets"].items():
        lines.append(f"- **{DS_NAMES.get(ds, ds)}**: {x['n_prompts']} prompts ({x['n_skipped_too_long']} skipped as too "
                     f"long), formats {x['kinds']}, mean prompt {x['prompt_tokens_mean']:.0f} tokens, categories "
                     f"{x['categories']}.")
    lines.append("\nSources and formats: see `peagle/data/benchmarks.py` (module docstring).\n")
    samp = [(ds, x) for ds, x in res["datasets"].items() if x.get("samples")]
    if samp:
        lines.append("## Sample outputs (baseline, greedy)\n")
        for ds, x in samp:
            for smp in x["samples"][:2]:
                lines.append(f"*{DS_NAMES.get(ds, ds)} {smp['id']}* ({smp['category']}):\n\n```\n{smp['output']}\n```\n")
    lines += ["## All runs\n", runs_md(res), ""]
    return "\n".join(lines)


def read_notes(path: str | None) -> str | None:
    """The --notes file's text (PeagleError if it cannot be read)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise PeagleError(f"--notes {path}: {e.strerror or e}") from None


def write_all(res, out, notes_path: str | None = None) -> list:
    os.makedirs(out, exist_ok=True)
    jp = os.path.join(out, "results.json")
    with open(jp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    pngs = write_plots(res, summarize(res), out)
    mp = os.path.join(out, "report.md")
    notes = read_notes(notes_path)                 # before report.md is opened (and emptied)
    with open(mp, "w") as f:
        f.write(report_md(res, [os.path.basename(p) for p in pngs], notes))
    return [jp, mp] + pngs
