"""PNG plots of a benchmark summary (matplotlib, headless)."""
from __future__ import annotations

import os

from .summary import DS_NAMES, NAMES

COLORS = {"baseline": "#555555", "eagle3": "#1f77b4", "peagle": "#d62728", "hf": "#2ca02c", "hf-pld": "#9467bd"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def throughput(s, out, peers=()) -> str:
    plt = _plt()
    dss = s["datasets"]
    fig, axes = plt.subplots(1, len(dss), figsize=(4.6 * len(dss), 3.8), squeeze=False)
    for ax, ds in zip(axes[0], dss):
        for m in ("baseline", "eagle3", "peagle"):
            pts = [(c, s["best"][(ds, m, c)]) for c in s["cs"] if (ds, m, c) in s["best"]]
            if not pts:
                continue
            ax.plot([c for c, _ in pts], [x["tok_s"] for _, x in pts], "o-", color=COLORS[m],
                    label=NAMES[m] + (" (best K)" if m != "baseline" else ""))
            if m != "baseline":
                for c, x in pts:
                    ax.annotate(f"K{x['k']}", (c, x["tok_s"]), fontsize=6, xytext=(2, 3), textcoords="offset points")
                au = [(c, s["auto"][(ds, m, c)]["tok_s"]) for c in s["cs"] if (ds, m, c) in s.get("auto", {})]
                if au:
                    ax.plot(*zip(*au), "s--", color=COLORS[m], alpha=0.8, label=NAMES[m] + " auto")
        for r in peers:
            if r["dataset"] == ds and not r.get("subset"):
                ax.plot([1], [r["output_tok_s"]], "*", ms=9, color=COLORS.get(r["method"], "k"),
                        label={"hf": "HF generate", "hf-pld": "HF prompt lookup"}.get(r["method"], r["method"])
                        + f" ({r['n_requests']} prompts)")
        _by_concurrency(ax, s, ds, "output tokens/s", 7)
    return _save(plt, fig, out, "throughput_vs_concurrency.png")


def _by_concurrency(ax, s, ds, ylabel, legend_size):
    ax.set_xscale("log", base=2)
    ax.set_xticks(s["cs"])
    ax.set_xticklabels([str(c) for c in s["cs"]])
    ax.set_title(DS_NAMES.get(ds, ds))
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


# every plot's file name (bench --out: command.OUTPUTS names an earlier run's left there)
FILES = ("throughput_vs_concurrency.png", "acceptance_vs_k.png", "drafter_time_vs_k.png", "auto_vs_static.png")


def _save(plt, fig, out, name) -> str:
    assert name in FILES, name
    fig.tight_layout()
    p = os.path.join(out, name)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def acceptance(s, out) -> str:
    plt = _plt()
    dss, c1, ks = s["datasets"], min(s["cs"]), s["ks"]
    fig, axes = plt.subplots(2, len(dss), figsize=(4.6 * len(dss), 7), squeeze=False)
    for j, ds in enumerate(dss):
        ax = axes[0][j]
        for m in ("eagle3", "peagle"):
            pts = [(k, s["agg"][(ds, m, k, c1)]["al"]) for k in ks if (ds, m, k, c1) in s["agg"]]
            if pts:
                ax.plot(*zip(*pts), "o-", color=COLORS[m], label=NAMES[m])
        ax.set_title(f"{DS_NAMES.get(ds, ds)}: acceptance length")
        ax.set_xlabel("K (num_speculative_tokens)")
        ax.set_ylabel("mean acceptance length")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][j]
        for m, ls in (("eagle3", "--"), ("peagle", "-")):
            for i, k in enumerate(ks):
                v = s["agg"].get((ds, m, k, c1))
                if v and v["per_pos"]:
                    ax.plot(range(1, len(v["per_pos"]) + 1), v["per_pos"], ls, marker=".", color=COLORS[m],
                            alpha=0.35 + 0.65 * (i + 1) / len(ks), label=f"{NAMES[m]} K={k}")
        ax.set_title(f"{DS_NAMES.get(ds, ds)}: per-position acceptance")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (of drafts)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    return _save(plt, fig, out, "acceptance_vs_k.png")


def drafter_time(s, out) -> str:
    plt = _plt()
    c1, ks = min(s["cs"]), s["ks"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for m in ("eagle3", "peagle"):
        d, v = [], []
        for k in ks:
            xs = [s["agg"][(ds, m, k, c1)] for ds in s["datasets"] if (ds, m, k, c1) in s["agg"]]
            xs = [x for x in xs if x["draft_ms"] is not None]     # online runs have no drafter timing
            if xs:
                xs_d = sorted(x["draft_ms"] for x in xs)
                xs_v = sorted(x["verify_ms"] for x in xs)
                d.append((k, xs_d[len(xs_d) // 2]))
                v.append((k, xs_v[len(xs_v) // 2]))
        if d:
            ax.plot(*zip(*d), "o-", color=COLORS[m], label=f"{NAMES[m]} drafter")
            ax.plot(*zip(*v), "x:", color=COLORS[m], alpha=0.6, label=f"{NAMES[m]} verify (target)")
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel(f"ms per engine step (c={c1})")
    ax.set_xticks(ks)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:                                        # online-only runs: the timing split lives in the server
        ax.text(0.5, 0.5, "no drafter timing (online runs)", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Drafter vs verification time per step")
    return _save(plt, fig, out, "drafter_time_vs_k.png")


def auto_vs_best(s, out) -> str:
    """auto ÷ max(best static K, baseline) and auto ÷ baseline per concurrency, with the goal lines."""
    plt = _plt()
    dss = s["datasets"]
    fig, axes = plt.subplots(1, len(dss), figsize=(4.6 * len(dss), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], dss):
        for m in ("eagle3", "peagle"):
            for key, ls, lab in (("auto_vs_best", "o-", "÷ max(best K, baseline)"), ("auto_vs_baseline", "x:",
                                                                                    "÷ baseline")):
                pts = [(c, s["speed"][(ds, c)][f"{m}_{key}"]) for c in s["cs"]
                       if s["speed"][(ds, c)].get(f"{m}_{key}") is not None]
                if pts:
                    ax.plot(*zip(*pts), ls, color=COLORS[m], label=f"{NAMES[m]} auto {lab}")
        ax.axhline(0.95, color="#999999", lw=0.8, ls="--")
        ax.axhline(1.0, color="#555555", lw=0.8)
        _by_concurrency(ax, s, ds, "output tokens/s ratio", 6)
    return _save(plt, fig, out, "auto_vs_static.png")


def write_plots(res, s, out) -> list:
    ps = [throughput(s, out, res.get("peers", []))]
    if s.get("auto"):
        ps.append(auto_vs_best(s, out))
    if s["ks"]:
        ps += [acceptance(s, out), drafter_time(s, out)]
    return ps
