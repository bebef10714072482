"""Chain vs token-tree report of a `peagle bench --trees` run (results.json): per dataset and concurrency, every
drafter run with its tree (or chain), acceptance length, draft nodes verified per step, tokens/s, the speedup
over the same head's chain at the same K and over plain decoding, per-depth acceptance and greedy identity.

    python -m peagle.bench.trees_report OUT/results.json [--out OUT/trees.md]"""
from __future__ import annotations

import argparse
import json
import statistics

from .runner import split_method
from .summary import paced


def _f(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"


def rows(res: dict) -> list[dict]:
    """One row per (dataset, c, method label, K): medians over repeats (tokens/s at the baseline's pace:
    summary.paced)."""
    runs = res.get("runs", [])
    pace = paced(runs)
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["concurrency"], r["method"], r["k"]), []).append(r)
    out = []
    for (ds, c, label, k), rs in groups.items():
        m = rs[0]["metrics"]
        method, tree = split_method(label)
        k_int = k if isinstance(k, int) else 0
        nodes = m.get("mean_tree_nodes_per_step")
        if nodes is None and method != "baseline":
            nodes = m.get("mean_num_speculative_tokens")          # a chain verifies its K drafts
        ok = [x.get("identity", {}).get("ok") for x in rs]
        out.append({"dataset": ds, "c": c, "method": method, "label": label, "k": k,
                    "tree": "chain" if tree is None else f"{tree[0]}x{tree[1]}",
                    "al": m.get("mean_acceptance_length"), "nodes": nodes,
                    "tok_s": statistics.median(pace[id(x)] for x in rs),
                    "per_depth": (m.get("acceptance_rate_per_pos") or [])[:max(k_int, 0)],
                    "identical": None if None in ok else all(ok)})
    return out


def render(res: dict) -> str:
    rs = rows(res)
    base = {(r["dataset"], r["c"]): r["tok_s"] for r in rs if r["method"] == "baseline"}
    chain = {(r["dataset"], r["c"], r["method"], r["k"]): r for r in rs if r["tree"] == "chain"}
    cmd = res.get("meta", {}).get("command", "")
    lines = ["# Token trees vs chains", "", f"Command: `{cmd}`", "",
             "AL: mean acceptance length (tokens per step per request); nodes: draft nodes verified per step and "
             "request (a chain: its K); vs chain: tokens/s over the same head's chain at the same K; per-depth: "
             "the fraction of steps that accepted a draft at depth 1, 2, ...", ""]
    for ds in dict.fromkeys(r["dataset"] for r in rs):
        for c in sorted({r["c"] for r in rs if r["dataset"] == ds}):
            lines += [f"## {ds}, c = {c}", "",
                      "| method | K | tree | AL | nodes | tok/s | vs chain | vs plain | per-depth acceptance | "
                      "identical |", "|---|---|---|---|---|---|---|---|---|---|"]
            sel = [r for r in rs if r["dataset"] == ds and r["c"] == c]
            sel.sort(key=lambda r: (r["method"], str(r["k"]), r["tree"] != "chain", r["tree"]))
            for r in sel:
                ch = chain.get((ds, c, r["method"], r["k"]))
                vs_chain = r["tok_s"] / ch["tok_s"] if ch and r["tree"] != "chain" else None
                b = base.get((ds, c))
                lines.append(f"| {r['method']} | {r['k']} | {r['tree']} | {_f(r['al'])} | {_f(r['nodes'], 1)} | "
                             f"{_f(r['tok_s'], 1)} | {_f(vs_chain)} | {_f(r['tok_s'] / b if b else None)} | "
                             f"{' '.join(_f(x) for x in r['per_depth']) or '-'} | "
                             f"{'-' if r['identical'] is None else 'yes' if r['identical'] else 'NO'} |")
            lines.append("")
    return "\n".join(lines)


def write_trees_report(res: dict, path: str) -> str:
    with open(path, "w") as f:
        f.write(render(res) + "\n")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--out", default=None, help="write Markdown here (default: print)")
    a = p.parse_args(argv)
    with open(a.results) as f:
        res = json.load(f)
    if a.out:
        write_trees_report(res, a.out)
    else:
        print(render(res))


if __name__ == "__main__":
    main()
