"""`peagle bench` end to end on a tiny target with random heads: files written, figures consistent."""
import json
import os
import shlex

import pytest
import torch
from heads import save_random_head


@pytest.fixture(scope="module")
def bench_run(tiny_dirs, tmp_path_factory):
    from peagle.cli import main
    root = tmp_path_factory.mktemp("bench")
    tgt = tiny_dirs["llama"]
    e3 = save_random_head(tgt, str(root / "e3"), parallel=False)
    pe = save_random_head(tgt, str(root / "pe"), parallel=True)
    out = str(root / "out")
    rc = main(["bench", "--model", tgt, "--eagle3-head", e3, "--peagle-head", pe, "--num-prompts", "2",
               "--output-len", "12", "--ks", "1,3", "--concurrency", "1,3", "--peer-prompts", "1",
               "--threads", "1", "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        return out, json.load(f), tgt, e3, pe


def test_files_written(bench_run):
    out, res, *_ = bench_run
    for fn in ("results.json", "report.md", "throughput_vs_concurrency.png", "acceptance_vs_k.png",
               "drafter_time_vs_k.png"):
        p = os.path.join(out, fn)
        assert os.path.getsize(p) > 100, fn
    md = open(os.path.join(out, "report.md")).read()
    assert md.splitlines()[0].startswith("# peagle benchmark")
    assert "```\npeagle bench " in md and "--num-prompts 2" in md      # the regenerating command at the top
    assert "## Headline" in md and "P-EAGLE ÷ EAGLE-3" in md
    assert res["meta"]["versions"]["torch"] and res["meta"]["machine"]["cores"]


def test_figures_consistent(bench_run):
    _, res, *_ = bench_run
    assert set(res["datasets"]) == {"mtbench", "humaneval", "speed"}
    runs = res["runs"]
    # 3 datasets x 2 concurrencies x (baseline + 2 methods x 2 K + the baseline again: --ref-every 4)
    assert len(runs) == 3 * 2 * 6
    for r in runs:
        m = r["metrics"]
        assert r["output_tokens"] == sum(q["output_len"] for q in r["requests"])
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        for q in r["requests"]:                # TPOT: time after the first token, per token after the first
            if q["output_len"] > 1:
                assert q["tpot_s"] == pytest.approx((q["e2e_s"] - q["ttft_s"]) / (q["output_len"] - 1))
        assert r["identity"]["ok"] is True and r["identity"]["identical"] == r["n_requests"]
        if r["method"] == "baseline":
            assert m["num_drafts"] == 0
            continue
        assert m["num_drafts"] > 0
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
        assert m["num_draft_tokens"] == r["k"] * m["num_drafts"]
        assert sum(q["num_drafts"] for q in r["requests"]) == m["num_drafts"]
        assert sum(q["num_accepted"] for q in r["requests"]) == m["num_accepted_tokens"]
        pp = m["acceptance_rate_per_pos"]
        assert len(pp) == r["k"] and all(a >= b for a, b in zip(pp, pp[1:]))
        assert r["timing"]["drafter_propose_calls"] > 0 and r["timing"]["draft_ms_per_step"] > 0
    c3 = [r for r in runs if r["concurrency"] == 3]
    assert all(r["n_requests"] == 3 for r in c3)            # prompts repeated to fill the concurrency
    peers = [p for p in res["peers"] if not p.get("subset")]
    assert {p["method"] for p in peers} == {"hf", "hf-pld"}
    assert all(p["identity"]["ok"] for p in peers)           # HF greedy == peagle greedy on the same weights


def test_runner_matches_llm_api(bench_run):
    """The bench builds engines itself (one shared target): its outputs equal LLM.generate's."""
    from peagle import LLM, SamplingParams
    from peagle.bench.runner import Bench
    from peagle.data.benchmarks import load_dataset
    _, _, tgt, e3, pe = bench_run
    b = Bench(tgt, {"eagle3": e3, "peagle": pe})
    ids = [b.encode(p) for p in load_dataset("humaneval", 2)]
    sp = SamplingParams(temperature=0, max_tokens=10)
    r = b.run("peagle", 3, 2, ids, sp, 1024)
    llm = LLM(tgt, speculative_config={"method": "eagle3", "model": pe, "num_speculative_tokens": 3,
                                        "parallel_drafting": True}, max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], sp)
    assert r["_outputs"] == [o.outputs[0].token_ids for o in outs]
    assert r["metrics"]["num_accepted_tokens"] == llm.get_metrics()["num_accepted_tokens"]


def test_a_compiled_forward_stays_for_every_run(bench_run):
    """--compile puts the compiled forward on the target instance; each run wrapped it in its timer and then
    deleted the instance attribute, so every run after the first ran the target uncompiled (its flag still said
    compiled). The runs now leave the instance's own forward as they found it, and use it."""
    from peagle import SamplingParams
    from peagle.bench.runner import Bench
    _, _, tgt, _, _ = bench_run
    b = Bench(tgt, {})
    calls, eager = [], b.target.forward

    def compiled(*a, **kw):                          # stands in for torch.compile's wrapper
        calls.append(1)
        return eager(*a, **kw)
    b.target.forward = compiled
    sp = SamplingParams(temperature=0, max_tokens=4)
    for _ in range(2):
        n = len(calls)
        b.run("baseline", 0, 1, [[5, 6, 7]], sp, 64)
        assert len(calls) > n and b.target.forward is compiled


def test_rerender_from_json(bench_run, tmp_path):
    from peagle.cli import main
    out, *_ = bench_run
    rc = main(["bench", "--from-json", os.path.join(out, "results.json"), "--out", str(tmp_path)])
    assert rc == 0 and os.path.getsize(tmp_path / "report.md") > 1000


def test_auto_rows_in_tables_and_plots(tiny_dirs, tmp_path):
    """K "auto" as a method per drafter: identical outputs, the K it chose, its ratios and goals in the report."""
    from peagle.cli import main
    tgt = tiny_dirs["llama"]
    e3 = save_random_head(tgt, str(tmp_path / "e3"), parallel=False)
    pe = save_random_head(tgt, str(tmp_path / "pe"), parallel=True)
    out = str(tmp_path / "out")
    rc = main(["bench", "--model", tgt, "--eagle3-head", e3, "--peagle-head", pe, "--datasets", "humaneval",
               "--num-prompts", "2", "--output-len", "10", "--ks", "2,auto", "--concurrency", "1,3", "--peers", "",
               "--threads", "1", "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    auto = [r for r in res["runs"] if r["k"] == "auto"]
    assert sorted((r["method"], r["concurrency"]) for r in auto) == [("eagle3", 1), ("eagle3", 3), ("peagle", 1),
                                                                      ("peagle", 3)]
    for r in auto:
        m = r["metrics"]
        assert r["identity"]["ok"] is True and r["identity"]["identical"] == r["n_requests"]
        assert r["k_max"] == 7 and len(m["num_steps_per_k"]) == 8 and sum(m["num_steps_per_k"]) > 0
        assert 0 <= r["mean_k"] <= 7 and m["k_policy"]["mode"] == "auto"
    assert set(res["meta"]["autok_cost_models"]) == {"eagle3", "peagle"}
    assert res["meta"]["autok_cost_models"]["peagle"]["batch_sizes"] == [1, 2, 3]
    md = open(os.path.join(out, "report.md")).read()
    assert "## Choosing K per step (auto)" in md and "P-EAGLE auto ÷ max(best static K, baseline)" in md
    assert "EAGLE-3 auto ≥ 0.95 × max(best static K, baseline) at every concurrency" in md
    assert "P-EAGLE auto ≥ 1.0 × baseline at every concurrency" in md
    assert os.path.getsize(os.path.join(out, "auto_vs_static.png")) > 100
    assert "--ks 2,auto" in md


def test_the_reports_command_keeps_the_quantization():
    """A q4 sweep's report must say so: its command regenerates the same sweep (the default, auto, is named;
    the sweep replaces it by what auto resolved to)."""
    from peagle.bench.command import apply_defaults, canonical_command
    from peagle.cli import build_parser
    for argv, want in ((["--quantization", "q4"], "q4"), ([], "auto"), (["--quantization", "none"], "none")):
        a = build_parser("bench").parse_args(["bench", "--ks", "1", *argv])
        apply_defaults(a)
        assert canonical_command(a).split("--quantization ")[1].split()[0] == want


def test_the_reports_command_keeps_the_kv_cache_dtype():
    """A sweep on a bfloat16 KV cache: its command says so (the default, auto, is left out)."""
    from peagle.bench.command import apply_defaults, canonical_command
    from peagle.cli import build_parser
    for argv, want in ((["--kv-cache-dtype", "bfloat16"], True), ([], False)):
        a = build_parser("bench").parse_args(["bench", "--ks", "1", *argv])
        apply_defaults(a)
        assert ("--kv-cache-dtype bfloat16" in canonical_command(a)) == want


def test_the_bench_target_takes_the_kv_cache_dtype(bench_run):
    """Bench(kv_cache_dtype="bfloat16") runs every engine on a bfloat16 cache: its plain and speculative outputs
    agree, and they are LLM(kv_cache_dtype="bfloat16")'s."""
    from peagle import LLM, SamplingParams
    from peagle.bench.runner import Bench
    from peagle.data.benchmarks import load_dataset
    _, _, tgt, _, pe = bench_run
    b = Bench(tgt, {"peagle": pe}, kv_cache_dtype="bfloat16")
    assert b.target.new_cache(1, 8).k[0].dtype == torch.bfloat16
    ids = [b.encode(p) for p in load_dataset("humaneval", 2)]
    sp = SamplingParams(temperature=0, max_tokens=10)
    base, spec = b.run("baseline", 0, 2, ids, sp, 1024), b.run("peagle", 3, 2, ids, sp, 1024)
    assert base["_outputs"] == spec["_outputs"]
    llm = LLM(tgt, kv_cache_dtype="bfloat16", max_num_seqs=2)
    assert base["_outputs"] == [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": x} for x in ids], sp)]


def test_the_reports_command_keeps_the_target_backend():
    """--target-backend transformers was dropped: the printed command reran the sweep on the native backend."""
    from peagle.bench.command import apply_defaults, canonical_command
    from peagle.cli import build_parser
    a = build_parser("bench").parse_args(["bench", "--ks", "1", "--target-backend", "transformers"])
    apply_defaults(a)
    cmd = canonical_command(a)
    again = build_parser("bench").parse_args(shlex.split(cmd)[1:])
    assert again.target_backend == "transformers"


def test_the_reports_command_regenerates_every_setting():
    """The report's command, parsed again, gives the same value for every bench option (each set away from its
    default here): a flag canonical_command drops would rerun a different sweep. --quick is spelled out as the
    values it sets; --from-json only re-renders, so no command carries it."""
    from peagle.bench.command import apply_defaults, canonical_command
    from peagle.cli import build_parser
    argv = ["bench", "--model", "M", "--eagle3-head", "E", "--peagle-head", "P", "--datasets", "humaneval,speed",
            "--methods", "baseline,peagle,eagle3", "--ks", "2,auto", "--trees", "4x8", "--auto-k", '{"margin":0.05}',
            "--remeasure", "--concurrency", "1,3", "--num-prompts", "3", "--output-len", "7", "--mode", "both",
            "--temperature", "0.5", "--draft-sampling", "argmax", "--ignore-eos", "--no-fill-concurrency",
            "--repeats", "2", "--ref-every", "3", "--humaneval-format", "chat", "--mtbench-turns", "2", "--max-prompt-len", "99",
            "--peers", "hf", "--peer-prompts", "3", "--pld-tokens", "4", "--device", "cpu", "--dtype", "float32",
            "--compile", "--seed", "5", "--quantization", "q8", "--target-backend", "native", "--kv-cache-dtype",
            "bfloat16", "--threads", "1", "--random-heads", "--mask-token", "3", "--notes", "N.md", "--out", "O"]
    a = build_parser("bench").parse_args(argv)
    default = build_parser("bench").parse_args(["bench"])
    skip = {"command", "func", "from_json", "quick"}
    assert [k for k in vars(a) if k not in skip and getattr(a, k) == getattr(default, k)] == []
    apply_defaults(a)
    b = build_parser("bench").parse_args(shlex.split(canonical_command(a))[1:])
    apply_defaults(b)
    for k in vars(a):
        if k not in skip:
            x, y = getattr(a, k), getattr(b, k)
            assert (x.as_dict(), k) == (y.as_dict(), k) if k == "auto_k" else (x, k) == (y, k)


def test_online_servers_run_the_offline_settings():
    """The online server got no thread count (torch's default, while the report named --threads), and its
    speculative config dropped --draft-sampling and --auto-k: online and offline runs differed in settings."""
    from peagle.autok.config import AutoKConfig
    from peagle.bench.online import OnlineServer, spec_json
    cfg = json.loads(spec_json("peagle", "auto", "H", "argmax", AutoKConfig.from_dict({"margin": 0.05})))
    assert cfg["draft_sampling"] == "argmax" and cfg["auto_k"] == {"margin": 0.05} and cfg["parallel_drafting"]
    assert "draft_sampling" not in json.loads(spec_json("eagle3", 3, "H"))          # the default is not spelled out
    assert spec_json("baseline", 0, None) is None
    srv = OnlineServer("M", "eagle3", 3, "H", 4, 256, threads=1)
    assert srv.env["OMP_NUM_THREADS"] == "1" and OnlineServer("M", "baseline", 0, None, 4, 256).env is None
    extra = OnlineServer("M", "baseline", 0, None, 4, 256, kv_cache_dtype="bfloat16").args[3]
    assert extra[extra.index("--kv-cache-dtype") + 1] == "bfloat16"                 # the offline runs' KV cache


def test_peer_rows_take_the_mean_tpot_like_the_peers():
    """The c=1 subset row of a peagle run took the median TPOT under a column of means (the HF rows' mean)."""
    from peagle.bench.report import _subset
    reqs = [{"output_len": 5, "e2e_s": 1.0, "ttft_s": 0.1, "tpot_s": t} for t in (0.010, 0.010, 0.040)]
    row = _subset({"method": "baseline", "k": 0, "requests": reqs, "identity": {}}, 3)
    assert row["tpot_ms"]["mean"] == pytest.approx(20.0)


def _run(ds, method, k, tok_s, per_pos=(0.5, 0.2)):
    return {"dataset": ds, "method": method, "k": k, "concurrency": 1, "output_tok_s": tok_s,
            "ttft_ms": {"mean": 1.0}, "tpot_ms": {"mean": 1.0}, "wall_s": 1.0, "timing": {}, "mean_k": None,
            "identity": {"n": 1, "identical": 1},
            "metrics": {"mean_acceptance_length": 1.4, "acceptance_rate_per_pos": list(per_pos)}}


def test_summary_ratios_against_hand_computed_ones():
    """summarize() on hand-built runs: auto is measured against the faster of its best static K and plain
    decoding, per-position acceptance is the run's (in order), the ratios are what division gives (a mutation
    review: auto against the static K alone, and a reversed per-position list, passed the bench tests)."""
    from peagle.bench.summary import AUTO, aggregate, summarize
    runs = [_run("humaneval", "baseline", 0, 100.0), _run("humaneval", "eagle3", 1, 80.0),
            _run("humaneval", "eagle3", 3, 70.0), _run("humaneval", "eagle3", AUTO, 90.0),
            _run("humaneval", "peagle", 1, 120.0, (0.6, 0.3, 0.1)), _run("humaneval", "peagle", AUTO, 108.0)]
    sp = summarize({"datasets": ["humaneval"], "runs": runs})["speed"][("humaneval", 1)]
    assert sp["eagle3_auto_vs_best"] == pytest.approx(90 / 100) and sp["peagle_auto_vs_best"] == pytest.approx(108 / 120)
    assert sp["peagle_vs_eagle3"] == pytest.approx(120 / 80) and sp["eagle3_vs_baseline"] == pytest.approx(0.8)
    assert aggregate(runs)[("humaneval", "peagle", 1, 1)]["per_pos"] == [0.6, 0.3, 0.1]


def test_identity_counts_an_early_stop_as_a_mismatch_and_a_tie_only_at_a_tie():
    """Bench.identity: an output that stops early (a strict prefix of plain decoding's) is a mismatch, not a
    floating-point tie; a divergence is a tie only where the target's top-2 logits are that close."""
    import types

    from peagle.bench.runner import Bench
    me = types.SimpleNamespace(top2_gap=lambda ids: (0.0, 1e-3))          # the target: a tie at any divergence
    r = Bench.identity(me, [[1]], [[5, 6]], [[5, 6, 7]])
    assert not r["ok"] and len(r["mismatches"]) == 1 and not r["ties"]
    r = Bench.identity(me, [[1]], [[5, 9, 7]], [[5, 6, 7]])
    assert r["ok"] and len(r["ties"]) == 1
    me.top2_gap = lambda ids: (3.0, 1e-3)
    assert not Bench.identity(me, [[1]], [[5, 9, 7]], [[5, 6, 7]])["ok"]


def test_an_earlier_runs_files_in_out_are_kept_and_named(tiny_dirs, tmp_path, capsys):
    """Into an --out holding an earlier run's files this run does not write (trees.md of a run with --trees, the
    auto-K plot): they are left in place and named in one note; a file of this run's is not named, nor a file
    that is not bench's."""
    from peagle.cli import main
    out = tmp_path / "out"
    out.mkdir()
    for name in ("trees.md", "auto_vs_static.png", "report.md", "mine.txt"):
        (out / name).write_text("earlier")
    assert main(["bench", "--model", tiny_dirs["llama"], "--methods", "baseline", "--datasets", "humaneval",
                 "--num-prompts", "1", "--output-len", "4", "--concurrency", "1", "--peers", "", "--threads", "1",
                 "--out", str(out)]) == 0
    note = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bench: note:")]
    assert note == [f"bench: note: trees.md, auto_vs_static.png in {out} are from an earlier run (this run wrote no "
                    "such file)"]
    assert (out / "trees.md").read_text() == "earlier" and (out / "mine.txt").read_text() == "earlier"
    assert (out / "report.md").read_text() != "earlier"
