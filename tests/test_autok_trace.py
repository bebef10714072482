"""The per-step trace of "auto" (peagle/autok/trace.py): switched on by AutoKConfig(trace=...) or
$PEAGLE_AUTOK_TRACE, one JSON line per decode step with the K chosen and why, predicted vs measured step time
and tokens; it never changes a decision; summarize() condenses it. Scripted engine (tests/autok_sim.py), no
wall clock, except the last test (the real engine through LLM)."""
import io
import json

import pytest
from autok_sim import autok_config, geometric, run
from test_autok_guard import K, fooled, grid, linear

from peagle.autok import trace as tr
from peagle.autok.acceptance import Acceptance
from peagle.autok.auto import AutoK
from peagle.autok.factory import auto_policy


def traced(steps=300, noise=0.1, guard=True, **kw):
    truth, believed, drafter = fooled()            # the model drafts, the guard falls back: every kind of step
    buf = io.StringIO()
    pol = AutoK(K, believed, Acceptance(K, prior=[0.8] * K), autok_config(guard=guard, trace=buf))
    res = run(pol, steps, truth, drafter, noise=noise, **kw)
    return res, [json.loads(ln) for ln in buf.getvalue().splitlines()], pol


def test_one_line_per_step_with_what_was_chosen_predicted_and_measured():
    res, recs, pol = traced()
    start, steps = recs[0], recs[1:]
    assert start["event"] == "start" and start["k_max"] == K and start["guard"]["window"] == 32
    assert [r["event"] for r in steps] == ["step"] * len(res["k"])
    assert [r["k"] for r in steps] == res["k"] and [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    assert len({r["run"] for r in recs}) == 1
    forced = [r["forced"] for r in steps]
    assert forced[0] == "plain_refresh" and "fallback" in forced
    assert all(r["k"] == 0 for r in steps if r["forced"])
    assert any(r["k_model"] for r in steps if r["forced"] == "fallback")     # the model wanted to draft
    for r in steps:
        assert r["step_s"] > 0 and r["pred_step_s"] > 0 and r["pred_tokens"] >= r["batch_size"]
        assert r["tokens"] >= r["batch_size"] and len(r["alpha"]) == K
        assert len(r["per_k"]["step_s"]) == K + 1 == len(r["per_k"]["tokens"])
        assert r["pred_step_s"] == pytest.approx(r["per_k"]["step_s"][r["k"]], rel=1e-4) or r["catch_up_rows"]
    first = next(r for r in steps if r["k"])       # the fooled cost model, visible at its first drafting step
    assert first["step_s"] / first["pred_step_s"] > 2
    verdicts = [r["guard"]["verdict"] for r in steps if "guard" in r]
    assert verdicts and verdicts[0] == "failed"


def test_summary_explains_the_run():
    res, recs, pol = traced(steps=600, noise=0.0)
    s = tr.summarize(recs)
    (run_id, sm), = s.items()
    assert sm["steps"] == len(res["k"]) and sm["tokens"] == res["tokens"]
    assert {int(k): v["steps"] for k, v in sm["per_k"].items()} == {k: res["k"].count(k) for k in set(res["k"])}
    assert sm["per_k"]["0"]["time_ratio"] == pytest.approx(1.0, abs=0.01)         # plain: as measured
    spec = [v for k, v in sm["per_k"].items() if k != "0"]
    assert sum(v["time_ratio"] * v["steps"] for v in spec) / sum(v["steps"] for v in spec) > 1.2   # drafting: not
    assert sm["fallbacks"] == pol.guard.stats["fallbacks"] > 0
    assert sm["forced"]["fallback"] == pol.guard.stats["fallback_steps"]
    assert sm["vs_plain"] == pytest.approx(res["vs_plain"], rel=0.01)     # exact plain reference: no noise


def test_tracing_never_changes_a_decision():
    a = run(AutoK(K, fooled()[1], Acceptance(K, prior=[0.8] * K), autok_config(trace=False)), 400, fooled()[0],
            fooled()[2], noise=0.1)
    b, _, _ = traced(steps=400)
    assert a["k"] == b["k"] and a["seconds"] == b["seconds"]


def test_switched_on_by_the_environment_and_read_back(tmp_path, monkeypatch, capsys):
    path = tmp_path / "t" / "autok.jsonl"
    monkeypatch.setenv(tr.ENV, str(path))
    step = linear(2e-3)
    for _ in range(2):                              # two runs append to one file
        pol = auto_policy(grid(step), {}, K)
        run(pol, 50, step, geometric(0.6))
    recs = tr.read(path)
    runs = {r["run"] for r in recs}
    assert len(runs) == 2 and sum(r["event"] == "start" for r in recs) == 2
    assert sum(r["event"] == "step" for r in recs) == 100
    assert tr.main([str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert set(shown) == runs and all(v["steps"] == 50 for v in shown.values())
    monkeypatch.delenv(tr.ENV)
    assert auto_policy(grid(step), {}, K).trace is None


def test_the_guard_is_set_by_the_config_and_overridden_by_the_environment(monkeypatch):
    step = linear(2e-3)
    assert auto_policy(grid(step), {}, K).guard.enabled
    assert not auto_policy(grid(step), {}, K, autok_config(guard=False)).guard.enabled
    monkeypatch.setenv("PEAGLE_AUTOK_GUARD", "0")
    assert not auto_policy(grid(step), {}, K).guard.enabled
    assert not auto_policy(grid(step), {}, K, autok_config(guard=True)).guard.enabled    # the A/B override wins
    monkeypatch.setenv("PEAGLE_AUTOK_GUARD", "1")
    assert auto_policy(grid(step), {}, K, autok_config(guard=False)).guard.enabled


def test_the_margin_can_be_set_by_the_environment_and_bad_values_are_refused(monkeypatch):
    from peagle.autok.config import MARGIN
    from peagle.errors import PeagleError
    step = linear(2e-3)
    assert auto_policy(grid(step), {}, K).margin == MARGIN
    assert auto_policy(grid(step), {}, K, autok_config(margin=0.3)).margin == 0.3
    monkeypatch.setenv("PEAGLE_AUTOK_MARGIN", "0.05")
    assert auto_policy(grid(step), {}, K).margin == 0.05
    assert auto_policy(grid(step), {}, K, autok_config(margin=0.3)).margin == 0.05
    for bad in ("-0.1", "five", "nan"):
        monkeypatch.setenv("PEAGLE_AUTOK_MARGIN", bad)
        with pytest.raises(PeagleError, match="PEAGLE_AUTOK_MARGIN"):
            auto_policy(grid(step), {}, K)


def test_probing_is_off_by_default_and_set_by_the_environment(monkeypatch):
    from peagle.autok.config import PROBE_TOL
    from peagle.errors import PeagleError
    step = linear(2e-3)
    assert auto_policy(grid(step), {}, K).probe_tol is None
    assert auto_policy(grid(step), {}, K, autok_config(probe_tol=0.05)).probe_tol == 0.05
    for v, want in (("on", PROBE_TOL), ("0.2", 0.2), ("off", None)):
        monkeypatch.setenv("PEAGLE_AUTOK_PROBE", v)
        assert auto_policy(grid(step), {}, K).probe_tol == want
    monkeypatch.setenv("PEAGLE_AUTOK_PROBE", "on")
    assert auto_policy(grid(step), {}, K, autok_config(guard=False)).probe_tol is None   # probing needs the guard
    for bad in ("1.5", "-0.1", "sometimes"):
        monkeypatch.setenv("PEAGLE_AUTOK_PROBE", bad)
        with pytest.raises(PeagleError, match="PEAGLE_AUTOK_PROBE"):
            auto_policy(grid(step), {}, K)


def test_trace_of_a_real_engine_run(tiny_dirs, tmp_path, monkeypatch):
    """LLM with "auto" and $PEAGLE_AUTOK_TRACE: one step line per decode step the engine counted, with the
    measured step time the engine reported; greedy outputs unchanged."""
    from heads import save_random_head
    from test_engine_lossless import ids, prompts

    from peagle import LLM, SamplingParams
    target = tiny_dirs["llama"]
    head = save_random_head(target, str(tmp_path / "h"), layers=1, parallel=True)
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(tr.ENV, str(path))
    ps = prompts(4, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(target, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": "auto",
                                          "parallel_drafting": True, "max_num_speculative_tokens": 3}, max_num_seqs=2)
    assert ids(llm.generate(ps, sp)) == ids(LLM(target).generate(ps, sp))
    steps = [r for r in tr.read(path) if r["event"] == "step"]
    per_k = llm.get_metrics()["num_steps_per_k"]
    assert len(steps) == sum(per_k) and [sum(r["k"] == k for r in steps) for k in range(len(per_k))] == per_k
    assert all(r["step_s"] > 0 and r["plain_step_s"] > 0 for r in steps) and steps[0]["forced"] == "plain_refresh"
    assert sum(r["tokens"] for r in steps) >= len(ps) * (sp.max_tokens - 1)


def test_the_summary_command_answers_help_and_bad_files_in_one_line(tmp_path, capsys):
    """`python -m peagle.autok.trace --help` opened a file named --help (a traceback), as did a missing file."""
    from peagle.autok.trace import main
    assert main(["--help"]) == 0 and "usage" in capsys.readouterr().out
    assert main([str(tmp_path / "none.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("peagle: error:") and len(err.strip().splitlines()) == 1
