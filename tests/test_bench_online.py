"""`peagle bench --mode both`: the online sweep through real `peagle serve` subprocesses (official openai client,
streaming) gives the same greedy tokens and acceptance as the offline sweep through the engine."""
import json
import os
import shutil

import pytest
from heads import save_random_head


@pytest.fixture(scope="module")
def online_run(tiny_dirs, tmp_path_factory):
    from tiny import make_tiny_tokenizer

    from peagle.cli import main
    root = tmp_path_factory.mktemp("bench-online")
    tgt = str(root / "target")
    shutil.copytree(tiny_dirs["llama"], tgt)
    make_tiny_tokenizer(tgt)
    e3 = save_random_head(tgt, str(root / "e3"), parallel=False)
    pe = save_random_head(tgt, str(root / "pe"), parallel=True)
    out = str(root / "out")
    with pytest.MonkeyPatch.context() as mp:      # a key meant for another server is not passed on to bench's own
        mp.setenv("VLLM_API_KEY", "sk-for-some-other-server")
        rc = main(["bench", "--model", tgt, "--eagle3-head", e3, "--peagle-head", pe, "--datasets",
                   "humaneval,mtbench", "--num-prompts", "2", "--output-len", "12", "--ks", "3", "--concurrency",
                   "1,3", "--peers", "", "--threads", "1", "--mode", "both", "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        return out, json.load(f)


def test_online_equals_offline(online_run):
    out, res = online_run
    off = {(r["dataset"], r["method"], r["k"], r["concurrency"]): r for r in res["runs"]}
    on = res["online_runs"]
    assert len(on) == len(off) == 2 * 2 * 3               # datasets x concurrencies x (baseline, eagle3, peagle)
    for r in on:
        o = off[(r["dataset"], r["method"], r["k"], r["concurrency"])]
        assert r["errors"] == [] and r["server_idle_after"] and r["server_step_errors"] == 0
        assert r["n_requests"] == o["n_requests"] and r["output_tokens"] == o["output_tokens"]
        assert [q["hash"] for q in r["requests"]] == [q["hash"] for q in o["requests"]]   # same greedy tokens
        assert r["identity"]["ok"] and r["identity"]["identical"] == r["n_requests"]
        assert r["ttft_ms"]["mean"] > 0 and r["output_tok_s"] > 0
        if r["method"] != "baseline":                       # server /metrics counters, this run only
            assert r["metrics"]["num_drafts"] > 0
            assert r["metrics"]["num_steps_per_k"][3] > 0 and r["mean_k"] == 3 == o["mean_k"]   # K histogram
            assert r["metrics"]["mean_acceptance_length"] == pytest.approx(
                o["metrics"]["mean_acceptance_length"], abs=0.15)
    md = open(os.path.join(out, "report.md")).read()
    assert "## Online: through the server" in md and "--mode both" in md


def test_online_only_report(online_run, tmp_path):
    """An online-only results.json renders on its own (the online runs become the main figures)."""
    from peagle.cli import main
    out, res = online_run
    res = dict(res, runs=[], peers=[])
    p = tmp_path / "on.json"
    p.write_text(json.dumps(res))
    assert main(["bench", "--from-json", str(p), "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Online through `peagle serve`" in md and "## Headline" in md


def test_online_only_sweep_runs(online_run, tmp_path):
    """`--mode online` alone: no offline run precedes the servers (its report is written once they have run)."""
    from peagle.cli import main
    out, res = online_run
    root = os.path.dirname(out)                          # the fixture's target and heads
    tgt, pe = os.path.join(root, "target"), os.path.join(root, "pe")
    rc = main(["bench", "--model", tgt, "--peagle-head", pe, "--methods", "baseline,peagle", "--datasets", "humaneval",
               "--num-prompts", "2", "--output-len", "8", "--ks", "3", "--concurrency", "1", "--peers", "",
               "--threads", "1", "--mode", "online", "--out", str(tmp_path / "on")])
    assert rc == 0
    got = json.loads((tmp_path / "on" / "results.json").read_text())
    assert got["runs"] == [] and [r["method"] for r in got["online_runs"]] == ["baseline", "peagle"]
    assert all(r["identity"]["ok"] for r in got["online_runs"])
    assert "Online through `peagle serve`" in (tmp_path / "on" / "report.md").read_text()
