"""The benchmark's number crunching on hand-made run records: medians over repeats, the best static K, the
speedup ratios and goals of every report, the per-request statistics and the losslessness check. Each test here
was written against a mutant of peagle/bench (summary.py, goals.py, runner.py) that the end-to-end bench tests
let through (a mutation review): a ratio upside down, the worst concurrency replaced by the best, a missing
measurement counted as a met goal, a divergence looked up one token late, ..."""
import types

import pytest
import torch

from peagle.bench.goals import goals_md, needed_md, same_k_md, why_md
from peagle.bench.runner import Bench, out_hash, stats_ms
from peagle.bench.summary import AUTO, aggregate, baseline_noise, paced, percentile, summarize


def _run(ds, method, k, tok_s, c=1, **kw):
    """One results.json run record, reduced to what summary.py reads."""
    r = {"dataset": ds, "method": method, "k": k, "concurrency": c, "output_tok_s": tok_s,
         "ttft_ms": {"mean": 1.0}, "tpot_ms": {"mean": 1.0}, "wall_s": 1.0, "timing": {}, "mean_k": None,
         "identity": {"n": 1, "identical": 1},
         "metrics": {"mean_acceptance_length": 1.4, "acceptance_rate_per_pos": [0.5, 0.2]}}
    r.update(kw)
    return r


def _sweep(tok_s, ds=("humaneval",)):
    """Runs from {(dataset, method, k, c): tokens/s}."""
    return {"datasets": list(ds), "runs": [_run(d, m, k, t, c) for (d, m, k, c), t in tok_s.items()]}


def _goal(s, prefix):
    (g,) = [g for g in s["goals"] if g["goal"].startswith(prefix)]
    return g


# ------------------------------------------------------------------ statistics
def test_percentile_is_the_nearest_rank_of_the_sorted_values():
    """p99 (the reports' tail latency) of ten values is the largest, whatever their order; an unsorted list or a
    rank rounded down (the second largest) passed the bench tests."""
    xs = [7, 3, 10, 1, 9, 2, 8, 4, 6, 5]
    assert percentile(xs, 99) == 10 and percentile(xs, 0) == 1 and percentile(xs, 50) == 5
    assert percentile([], 99) is None


def test_stats_ms_is_mean_median_and_p99_in_milliseconds_without_the_missing():
    """TTFT/TPOT/E2E figures: seconds in, milliseconds out; "mean" is the mean (the tables' column), not the
    median; a request with no TPOT (one output token) is left out, not a crash."""
    st = stats_ms([0.010, None, 0.020, 0.060])
    assert st == pytest.approx({"mean": 30.0, "median": 20.0, "p99": 60.0})
    assert stats_ms([None]) == {"mean": None, "median": None, "p99": None}


def test_out_hash_tells_token_boundaries_apart():
    """The per-request hash is the evidence that online and offline runs produced the same tokens: [1, 23] and
    [12, 3] must not hash alike (digits run together without a separator)."""
    assert out_hash([1, 23]) != out_hash([12, 3]) and out_hash([1, 2, 3]) == out_hash([1, 2, 3])
    assert len(out_hash([])) == 16


# ------------------------------------------------------------------ aggregate and summarize
def test_aggregate_takes_the_median_over_repeats():
    """--repeats: each figure is the median over the repeats (not their mean, not the best one); engine step
    time is wall time in ms per engine step."""
    runs = [_run("humaneval", "peagle", 3, t, ttft_ms={"mean": f}, wall_s=2.0, timing={"n_steps": 40})
            for t, f in ((100.0, 5.0), (10.0, 50.0), (40.0, 7.0))]
    a = aggregate(runs)[("humaneval", "peagle", 3, 1)]
    assert a["tok_s"] == 40.0 and a["ttft_ms"] == 7.0 and a["n_repeats"] == 3
    assert a["step_ms"] == pytest.approx(50.0) and a["draft_ms"] is None
    assert a["identical"] == 3 and a["n"] == 3


def test_ratios_compare_runs_at_the_baselines_pace_where_the_machine_drifts():
    """A machine that slows 10 % of its speed per time unit during a repeat: baseline 100 tok/s at t=0 and 70 at
    t=3, EAGLE-3 (truly 1.1x baseline) at t=1, P-EAGLE (1.3x) at t=2. Divided by the baseline interpolated at
    their times, the ratios are the true ones, where the raw figures give P-EAGLE 1.05x EAGLE-3; the baseline
    itself, and runs without a midpoint, keep their own figures; a run past the last baseline takes it."""
    def at(t, m, k, x):
        return _run("humaneval", m, k, x * (1 - 0.1 * t), t_mid=float(t))
    runs = [at(0, "baseline", 0, 100.0), at(1, "eagle3", 1, 110.0), at(2, "peagle", 1, 130.0), at(3, "baseline", 0, 100.0)]
    s = summarize({"datasets": ["humaneval"], "runs": runs})
    sp = s["speed"][("humaneval", 1)]
    assert sp["peagle_vs_eagle3"] == pytest.approx(130 / 110) and sp["peagle_vs_baseline"] == pytest.approx(1.3)
    assert sp["eagle3_vs_baseline"] == pytest.approx(1.1)
    agg = s["agg"]
    assert agg[("humaneval", "peagle", 1, 1)]["tok_s_raw"] / agg[("humaneval", "eagle3", 1, 1)]["tok_s_raw"] == \
        pytest.approx(104 / 99)                                             # what the raw medians said
    assert agg[("humaneval", "baseline", 0, 1)]["tok_s"] == pytest.approx(85.0)
    late = at(4, "peagle", 3, 130.0)
    pace = paced(runs + [late, _run("humaneval", "peagle", 5, 42.0)])
    assert pace[id(late)] == pytest.approx(130 * 0.6 / 70 * 85) and 42.0 in pace.values()
    other_repeat = dict(at(1, "eagle3", 1, 110.0), repeat=1)              # baselines of another repeat: not used
    assert paced(runs + [other_repeat])[id(other_repeat)] == pytest.approx(99.0)


def test_baseline_noise_is_the_median_gap_between_baseline_runs_adjacent_in_time():
    """Adjacent in time within a repeat, in time order (not list order): 100 -> 110 -> 88 is 10 % and 20 %, the
    next repeat's 200 -> 260 30 % (its 200 is no neighbour of the 88): median 20 %; a lone baseline or runs without
    t_mid give nothing."""
    def b(t, x, rep=0, c=1):
        return _run("humaneval", "baseline", 0, x, c=c, t_mid=t, repeat=rep)
    runs = [b(2.0, 88.0), b(0.0, 100.0), b(1.0, 110.0), b(5.0, 200.0, rep=1), b(6.0, 260.0, rep=1), b(0.0, 50.0, c=4),
            _run("humaneval", "peagle", 1, 500.0, t_mid=1.5), _run("mtbench", "baseline", 0, 10.0)]
    noise = baseline_noise(runs)
    assert set(noise) == {("humaneval", 1)} and noise[("humaneval", 1)] == pytest.approx(0.20)


def test_best_k_is_the_fastest_static_k_and_the_ratios_divide_the_right_way():
    """Best K per method is the static K with the most tokens/s (auto, faster still, is not a static K); the
    speedups are that K's tokens/s over the rival's; the static K list has neither baseline's 0 nor auto."""
    s = summarize(_sweep({("humaneval", "baseline", 0, 1): 50.0, ("humaneval", "eagle3", 1, 1): 60.0,
                          ("humaneval", "eagle3", 3, 1): 80.0, ("humaneval", "eagle3", AUTO, 1): 200.0,
                          ("humaneval", "peagle", 1, 1): 150.0, ("humaneval", "peagle", 3, 1): 100.0}))
    assert s["best"][("humaneval", "eagle3", 1)]["k"] == 3 and s["best"][("humaneval", "peagle", 1)]["k"] == 1
    sp = s["speed"][("humaneval", 1)]
    assert sp["peagle_vs_baseline"] == pytest.approx(3.0) and sp["eagle3_vs_baseline"] == pytest.approx(1.6)
    assert sp["peagle_vs_eagle3"] == pytest.approx(150 / 80)
    assert s["ks"] == [1, 3] and s["cs"] == [1]


def test_auto_vs_baseline_is_over_plain_decoding_not_over_the_best_k():
    """The auto-vs-baseline ratio divides by the baseline's tokens/s, even where a static K beats the baseline
    (then it differs from auto-vs-best)."""
    s = summarize(_sweep({("humaneval", "baseline", 0, 1): 100.0, ("humaneval", "peagle", 3, 1): 120.0,
                          ("humaneval", "peagle", AUTO, 1): 108.0}))
    sp = s["speed"][("humaneval", 1)]
    assert sp["peagle_auto_vs_baseline"] == pytest.approx(1.08) and sp["peagle_auto_vs_best"] == pytest.approx(0.9)


def test_the_report_is_about_the_offline_runs_when_there_are_both():
    """--mode both: the headline figures are the offline sweep's; the online runs only stand in when there is no
    offline run."""
    off = _sweep({("humaneval", "baseline", 0, 1): 100.0, ("humaneval", "peagle", 3, 1): 200.0})
    on = _sweep({("humaneval", "baseline", 0, 1): 100.0, ("humaneval", "peagle", 3, 1): 150.0})
    both = dict(off, online_runs=on["runs"])
    assert summarize(both)["speed"][("humaneval", 1)]["peagle_vs_baseline"] == pytest.approx(2.0)
    only_on = dict(off, runs=[], online_runs=on["runs"])
    assert summarize(only_on)["speed"][("humaneval", 1)]["peagle_vs_baseline"] == pytest.approx(1.5)


# ------------------------------------------------------------------ goals
def test_a_c1_goal_without_its_measurement_is_not_met():
    """A sweep without EAGLE-3 has no P-EAGLE ÷ EAGLE-3 ratio: that goal is unmeasured, not met."""
    s = summarize(_sweep({("humaneval", "baseline", 0, 1): 100.0, ("humaneval", "peagle", 3, 1): 400.0}))
    g = _goal(s, "P-EAGLE ÷ EAGLE-3, HumanEval, c=1")
    assert g["measured"] is None and g["met"] is False
    assert _goal(s, "P-EAGLE ÷ baseline, HumanEval, c=1")["met"] is True


def test_never_slower_is_the_worst_ratio_up_to_c64_inclusive():
    """"P-EAGLE never slower than EAGLE-3 up to c=64" reports the minimum ratio over datasets and concurrencies
    up to and including 64 (not the best one; c=64 counts, c=128 does not)."""
    t = {}
    for ds, c, ratio in (("humaneval", 1, 1.2), ("humaneval", 64, 0.9), ("humaneval", 128, 0.5),
                         ("mtbench", 1, 1.1), ("mtbench", 64, 1.3), ("mtbench", 128, 0.4)):
        t[(ds, "eagle3", 3, c)], t[(ds, "peagle", 3, c)] = 100.0, 100.0 * ratio
    s = summarize(_sweep(t, ("humaneval", "mtbench")))
    g = _goal(s, "P-EAGLE never slower")
    assert g["measured"] == pytest.approx(0.9) and g["where"] == "HumanEval, c=64" and g["met"] is False


def test_a_sweep_that_stops_below_c64_leaves_never_slower_undecided():
    """With no concurrency up to 64 measured past 8, the goal is undecided (not met) even where every measured
    ratio is ≥ 1, and the goals table says "undecided", not "not met"."""
    t = {}
    for c in (1, 8):
        t[("humaneval", "baseline", 0, c)], t[("humaneval", "eagle3", 3, c)] = 50.0, 100.0
        t[("humaneval", "peagle", 3, c)] = 120.0
    res = _sweep(t)
    s = summarize(res)
    g = _goal(s, "P-EAGLE never slower")
    assert g["measured"] == pytest.approx(1.2) and g["met"] is False and "undecided" in g["where"]
    row = [x for x in goals_md(s, res).splitlines() if x.startswith("| P-EAGLE never slower")][0]
    assert "| undecided |" in row and "not met" not in row


def test_auto_goals_take_the_worst_concurrency():
    """"auto ≥ 0.95 × max(best static K, baseline) at every concurrency": the measured figure is the minimum over
    the concurrencies, where it is missed."""
    t = {}
    for c, auto in ((1, 99.0), (4, 60.0)):
        t[("humaneval", "baseline", 0, c)], t[("humaneval", "peagle", 3, c)] = 50.0, 100.0
        t[("humaneval", "peagle", AUTO, c)] = auto
    s = summarize(_sweep(t))
    g = _goal(s, "P-EAGLE auto ≥ 0.95")
    assert g["measured"] == pytest.approx(0.6) and g["met"] is False and g["where"] == "minimum: HumanEval, c=4"
    g = _goal(s, "P-EAGLE auto ≥ 1.0")
    assert g["measured"] == pytest.approx(1.2) and g["met"] is True


def test_goals_table_shortfall_is_the_fraction_of_the_target_missed():
    """1.2× measured against a 1.5× target is missed by 20% (of the target)."""
    res = _sweep({("humaneval", "baseline", 0, 1): 100.0, ("humaneval", "eagle3", 3, 1): 100.0,
                  ("humaneval", "peagle", 3, 1): 120.0})
    row = [x for x in goals_md(summarize(res), res).splitlines() if x.startswith("| P-EAGLE ÷ EAGLE-3")][0]
    assert row.endswith("| **not met** | missed by 20% |") and "1.20×" in row


# ------------------------------------------------------------------ the goals page's tables
def _one(method, k, tok_s, al=2.5, draft=None, verify=None, wall=1.0, steps=None):
    timing = {} if draft is None else {"draft_ms_per_step": draft, "verify_ms_per_step": verify, "n_steps": steps}
    return _run("humaneval", method, k, tok_s, wall_s=wall, timing=timing,
                metrics={"mean_acceptance_length": al, "acceptance_rate_per_pos": [0.5]})


def test_why_md_divides_draft_time_by_verify_time():
    """Where the time goes: "draft ÷ verify" is the drafter's ms per step over the target's verify ms per step;
    engine ms/step is wall time over engine steps."""
    res = {"datasets": ["humaneval"], "runs": [_one("baseline", 0, 50.0, 1.0, 0.0, 10.0, 2.0, 100),
                                               _one("peagle", 3, 100.0, 2.5, 2.0, 8.0, 2.0, 50)]}
    rows = why_md(summarize(res), 1).splitlines()
    assert "| HumanEval | P-EAGLE | 3 | 2.50 | 2.00 | 8.00 | 40.00 | 20.00 | 0.25 |" in rows


def test_needed_md_gives_the_acceptance_length_the_goals_need():
    """Needed AL = goal × rival's tokens/s × P-EAGLE's step time (AL ÷ tokens/s); a step yields at most K+1."""
    res = {"datasets": ["humaneval"], "runs": [_one("baseline", 0, 50.0, 1.0), _one("eagle3", 3, 80.0, 2.0),
                                               _one("peagle", 3, 100.0, 2.5)]}
    rows = needed_md(summarize(res)).splitlines()
    assert "| HumanEval | 3 | 25.00 | 2.50 | 3.00 | 3.75 | 4 |" in rows        # 1.5×80×0.025, 3×50×0.025


def test_same_k_md_is_peagle_over_eagle3():
    """Equal-K table: P-EAGLE's tokens/s over EAGLE-3's (with both acceptance lengths)."""
    res = {"datasets": ["humaneval"], "runs": [_one("eagle3", 3, 80.0, 2.0), _one("peagle", 3, 100.0, 2.5)]}
    assert "| HumanEval | 1 | 1.25× (2.50 vs 2.00) |" in same_k_md(summarize(res)).splitlines()


# ------------------------------------------------------------------ losslessness
class _Bigram:
    """A stand-in target whose next-token logits depend only on the last token: rows[last token] (others: 0)."""

    def __init__(self, rows):
        self.rows = rows

    def new_cache(self, b, n):
        return None

    def forward(self, x, cache, b0, pos, logits_at, span, s0):
        last = int(x[0, int(logits_at[0])])
        return torch.tensor([self.rows.get(last, [0.0, 0.0, 0.0])], dtype=torch.float32), None


def _bench(rows, dtype=torch.bfloat16):
    me = types.SimpleNamespace(target=_Bigram(rows), device=torch.device("cpu"), dtype=dtype)
    me.top2_gap = lambda ids: Bench.top2_gap(me, ids)
    return me


def test_top2_gap_reads_the_last_positions_logits_and_the_dtype_spacing_there():
    """The gap is between the two best logits after the last token of ids (not one before); one rounding step of
    bfloat16 at a logit of 20 is 0.125 (2^4 × 2^-7), of float32 2^4 × 2^-23."""
    me = _bench({7: [20.0, 19.5, 1.0], 3: [5.0, 5.0, 5.0]})
    gap, step = Bench.top2_gap(me, [3, 7])
    assert gap == pytest.approx(0.5) and step == 0.125
    assert Bench.top2_gap(_bench({7: [20.0, 19.5, 1.0]}, torch.float32), [3, 7])[1] == 2.0 ** -19


def test_identity_looks_up_the_tie_where_the_outputs_diverge():
    """A divergence is judged by the target's logits after the prompt and the common prefix: here the token
    after 5 is a tie (gap 0.125: one bfloat16 step at 20) while the one after 6 is not."""
    me = _bench({5: [20.0, 19.875, 0.0], 6: [20.0, 10.0, 0.0]})
    r = Bench.identity(me, [[1]], [[5, 9, 7]], [[5, 6, 7]])
    assert r["ok"] and r["ties"][0]["first_divergence"] == 1 and r["ties"][0]["top2_gap"] == 0.125


def test_identity_finds_a_divergence_at_the_first_token():
    """Outputs that differ from their first token diverge at 0: judged at the prompt's end (a tie here)."""
    me = _bench({1: [20.0, 20.0, 0.0]})
    r = Bench.identity(me, [[1]], [[9, 6]], [[5, 6]])
    assert r["ok"] and r["identical"] == 0 and r["ties"][0]["first_divergence"] == 0 and not r["mismatches"]


def test_identity_tie_tolerance_is_two_rounding_steps_of_the_dtype():
    """A gap within two rounding steps of the run's dtype (bfloat16 at 20: 2 × 0.125) is a tie even above
    tie_eps; a gap past them is a real mismatch."""
    for gap, tie in ((0.2, True), (0.3, False)):
        r = Bench.identity(_bench({5: [20.0, 20.0 - gap, 0.0]}), [[1]], [[5, 9]], [[5, 6]])
        assert (len(r["ties"]), len(r["mismatches"]), r["ok"]) == ((1, 0, True) if tie else (0, 1, False)), gap


# ------------------------------------------------------------------ one run's metrics (tiny target)
@pytest.fixture(scope="module")
def tiny_bench(target, heads):
    return Bench(target, {"peagle": heads["peagle"]})


def test_a_runs_timing_split_counts_prefill_and_verify_apart(tiny_bench):
    """Bench.run's figures: the prefill forwards (with logits_at) are timed apart from the decode ones (plain
    decoding: one per token after each request's first; speculative at c=1: one verification per drafting
    step); verify ms per step is decode time over those forwards (a baseline run has no drafter calls to divide
    by), draft ms per step is propose time over propose calls, the rest of the wall time is "other"; tokens/s,
    requests/s and per-request TTFT/TPOT are what the requests say (a mutation review: prefill and decode
    swapped, verify time over the drafter's calls, passed the bench tests)."""
    from peagle import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    for method, k in (("baseline", 0), ("peagle", 3)):
        r = tiny_bench.run(method, k, 1, ids, sp, 64)
        t, q = r["timing"], r["requests"]
        assert [x["output_len"] for x in q] == [6, 6, 6] and r["output_tokens"] == 18
        n_verify = 15 if method == "baseline" else r["metrics"]["num_drafts"]
        assert t["target_decode_calls"] == n_verify and t["target_prefill_s"] > 0
        assert t["verify_ms_per_step"] == pytest.approx(1000 * t["target_decode_s"] / n_verify)
        parts = t["target_prefill_s"] + t["target_decode_s"] + t["drafter_prefill_s"] + t["drafter_propose_s"]
        assert t["other_s"] == pytest.approx(r["wall_s"] - parts) and t["other_s"] >= 0
        assert r["output_tok_s"] == pytest.approx(18 / r["wall_s"]) and r["req_s"] == pytest.approx(3 / r["wall_s"])
        assert all(0 < x["ttft_s"] <= x["e2e_s"] for x in q)
        assert r["ttft_ms"] == pytest.approx(stats_ms([x["ttft_s"] for x in q]))
        assert r["tpot_ms"]["mean"] == pytest.approx(1000 * sum((x["e2e_s"] - x["ttft_s"]) / 5 for x in q) / 3)
        if method == "baseline":
            assert t["drafter_propose_calls"] == 0 and t["draft_ms_per_step"] == 0.0
        else:
            assert t["drafter_propose_calls"] == r["metrics"]["num_drafts"] > 0 and t["drafter_prefill_s"] > 0
            assert t["draft_ms_per_step"] == pytest.approx(1000 * t["drafter_propose_s"] / t["drafter_propose_calls"])
