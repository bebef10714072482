"""report.md's tables on hand-made results: which figure sits under which column, which runs a table compares
(c=1, the first repeat, the peers' own prompts), the best K, the ratios' direction, what the losslessness line
adds up, and the lines that depend on the settings. Each test here was written against a mutant of
peagle/bench/report.py that the end-to-end bench tests let through (a mutation review): two columns swapped,
the largest concurrency taken for c=1, a ratio upside down, a repeat counted twice, a tie left out of the
table, the offline figures shown under the online heading, ..."""
import pytest

from peagle.bench.report import (
    acceptance_md,
    category_md,
    dataset_md,
    drafter_md,
    headline,
    identity_md,
    online_md,
    peers_md,
    report_md,
    runs_md,
    write_all,
)
from peagle.bench.summary import summarize
from peagle.errors import PeagleError


def _run(method, k, tok_s, c=1, ds="humaneval", rep=0, al=1.5, per_pos=(0.5,), ttft=10.0, tpot=2.0, draft=1.0,
         verify=4.0, identity=None, requests=(), **kw):
    """One results.json run record, with what report.py reads."""
    r = {"dataset": ds, "method": method, "k": k, "concurrency": c, "repeat": rep, "output_tok_s": tok_s,
         "n_requests": 2, "output_tokens": 20, "wall_s": 2.0, "ttft_ms": {"mean": ttft}, "tpot_ms": {"mean": tpot},
         "timing": {"draft_ms_per_step": draft, "verify_ms_per_step": verify}, "mean_k": None,
         "identity": identity or {"ok": True, "n": 2, "identical": 2, "ties": [], "mismatches": []},
         "metrics": {"mean_acceptance_length": al, "acceptance_rate_per_pos": list(per_pos)},
         "requests": list(requests)}
    r.update(kw)
    return r


def _res(runs, datasets=("humaneval",), **kw):
    res = {"datasets": {d: {} for d in datasets}, "runs": runs, "peers": []}
    res.update(kw)
    return res


def _lines(md):
    return md.splitlines()


def _three_methods():
    """Baseline, EAGLE-3 (best K=3) and P-EAGLE (best K=1) at c=1 and c=4, each with its own TTFT/TPOT."""
    runs = []
    for c, (b, e1, e3, p1, p3) in ((1, (100.0, 120.0, 150.0, 300.0, 250.0)), (4, (200.0, 210.0, 220.0, 330.0, 100.0))):
        runs += [_run("baseline", 0, b, c, al=1.0, ttft=10.0, tpot=1.0),
                 _run("eagle3", 1, e1, c, al=1.5, ttft=21.0, tpot=2.1), _run("eagle3", 3, e3, c, al=2.0, ttft=20.0, tpot=2.0),
                 _run("peagle", 1, p1, c, al=3.0, ttft=30.0, tpot=3.0), _run("peagle", 3, p3, c, al=2.5, ttft=31.0, tpot=3.1)]
    return runs


# ------------------------------------------------------------------ headline and per-dataset tables
def test_headline_tables_are_titled_by_their_ratio_and_have_one_column_per_concurrency():
    """Each headline table's title names the ratio in its cells, at two decimals, one column per concurrency."""
    md = headline(summarize(_res(_three_methods())))
    parts = {p.split("**")[0]: p for p in ("\n\n" + md).split("\n\n**")[1:]}
    assert "| HumanEval | 2.00× | 1.50× |" in _lines(parts["P-EAGLE ÷ EAGLE-3"])          # 300/150, 330/220
    assert "| HumanEval | 3.00× | 1.65× |" in _lines(parts["P-EAGLE ÷ baseline"])         # 300/100, 330/200
    assert "| HumanEval | 1.50× | 1.10× |" in _lines(parts["EAGLE-3 ÷ baseline"])         # 150/100, 220/200
    assert "| Benchmark | c=1 | c=4 |" in _lines(parts["EAGLE-3 ÷ baseline"])


def test_dataset_md_puts_each_methods_figures_under_its_own_column():
    """Per-dataset table: baseline, EAGLE-3, P-EAGLE (best K, AL), ratios and TTFT/TPOT each under its own header."""
    s = summarize(_res(_three_methods()))
    rows = _lines(dataset_md(s, "humaneval"))
    assert rows[0] == ("| c | baseline tok/s | EAGLE-3 best | P-EAGLE best | P ÷ E | P ÷ base | E ÷ base | "
                       "TTFT ms (b/E/P) | TPOT ms (b/E/P) |")
    assert ("| 1 | 100.0 | 150.0 (K=3, AL 2.00) | 300.0 (K=1, AL 3.00) | 2.00× | 3.00× | 1.50× | 10 / 20 / 30 | "
            "1.0 / 2.0 / 3.0 |") in rows
    assert "| 4 | 200.0 | 220.0 (K=3, AL 2.00) | 330.0 (K=1, AL 3.00) | 1.50× | 1.65× | 1.10× |" in " ".join(rows)


# ------------------------------------------------------------------ acceptance
def test_acceptance_md_is_at_the_lowest_concurrency_with_every_measured_k():
    """Acceptance tables: c=1's, a K measured on one dataset kept, per-position % in order, padded to the largest K."""
    runs = [_run("peagle", 3, 100.0, 1, al=2.5, per_pos=(0.9, 0.5, 0.2)),
            _run("peagle", 3, 100.0, 4, al=1.1, per_pos=(0.1, 0.1, 0.1)),
            _run("eagle3", 1, 100.0, 1, al=1.8, per_pos=(0.8,)), _run("eagle3", 1, 100.0, 4, al=1.2, per_pos=(0.2,)),
            _run("eagle3", 1, 100.0, 1, ds="mtbench", al=1.6, per_pos=(0.6,))]
    md = acceptance_md(summarize(_res(runs, ("humaneval", "mtbench"))))
    rows = _lines(md)
    assert "| mean acceptance length | HumanEval | MT-Bench |" in rows
    assert "| P-EAGLE K=3 | 2.50 | – |" in rows and "| EAGLE-3 K=1 | 1.80 | 1.60 |" in rows
    he = md.split("*HumanEval*")[1].split("*MT-Bench*")[0]
    assert "| per-position acceptance | 1 | 2 | 3 |" in _lines(he)
    assert "| P-EAGLE K=3 | 90% | 50% | 20% |" in _lines(he) and "| EAGLE-3 K=1 | 80% |  |  |" in _lines(he)


# ------------------------------------------------------------------ per category
def _cat_run(method, k, drafts_acc, c=1, rep=0):
    reqs = [{"id": i, "num_drafts": d, "num_accepted": a} for i, (d, a) in enumerate(drafts_acc)]
    return _run(method, k, 100.0, c, rep=rep, requests=reqs)


def test_category_md_is_acceptance_per_category_of_the_first_c1_repeat():
    """Per category AL = 1 + accepted ÷ drafts of c=1 repeat-0 drafter runs, by method then K; one category: no table."""
    res = _res([_cat_run("baseline", 0, [(0, 0)] * 3),
                _cat_run("peagle", 1, [(4, 4), (5, 0), (4, 2)]), _cat_run("eagle3", 3, [(2, 2), (2, 1), (2, 0)]),
                _cat_run("peagle", 1, [(1, 1), (1, 1), (1, 1)], rep=1), _cat_run("peagle", 1, [(1, 0)] * 3, c=4)],
               ("humaneval", "mtbench"))
    res["datasets"] = {"humaneval": {"categories_per_prompt": ["a", "b", "a"]},
                       "mtbench": {"categories_per_prompt": ["x", "x"]}}
    md = category_md(res, summarize(res))
    rows = _lines(md)
    assert "*MT-Bench*" not in md and rows[0] == "*HumanEval*"
    assert rows[2] == "| category | EAGLE-3 K=3 | P-EAGLE K=1 |"
    assert rows[4:] == ["| a | 1.50 | 1.75 |", "| b | 1.50 | 1.00 |"]       # a: 1+2/4, 1+6/8; b: 1+1/2, 1+0/5


# ------------------------------------------------------------------ drafter time
def test_drafter_md_gives_draft_then_verify_time_at_c1_median_over_datasets():
    """Drafter table: per K each drafter's draft then verify ms per step at c=1, median over the datasets."""
    runs = [_run("eagle3", 3, 1.0, 1, draft=1.0, verify=10.0), _run("eagle3", 3, 1.0, 1, ds="mtbench", draft=3.0, verify=20.0),
            _run("peagle", 3, 1.0, 1, draft=0.5, verify=8.0), _run("peagle", 3, 1.0, 1, ds="mtbench", draft=1.5, verify=12.0),
            _run("eagle3", 3, 1.0, 4, draft=9.0, verify=90.0), _run("peagle", 3, 1.0, 4, draft=9.0, verify=90.0)]
    rows = _lines(drafter_md(summarize(_res(runs, ("humaneval", "mtbench")))))
    assert rows[0] == "| K | EAGLE-3 draft ms/step | EAGLE-3 verify ms/step | P-EAGLE draft ms/step | P-EAGLE verify ms/step |"
    assert rows[2] == "| 3 | 2.00 | 15.00 | 1.00 | 10.00 |"


# ------------------------------------------------------------------ peers
def _reqs(*e2e, out=10):
    return [{"output_len": out, "e2e_s": t, "ttft_s": 0.1, "tpot_s": 0.01} for t in e2e]


def test_peers_md_compares_the_peers_prompts_with_the_best_k_of_the_first_repeat():
    """Peer table: repeat 0's c=1 runs over the peers' n prompts, fastest K, ratio over baseline, identical requests."""
    peer = {"dataset": "humaneval", "method": "hf", "k": 0, "n_requests": 2, "output_tok_s": 8.0,
            "ttft_ms": {"mean": 100.0}, "tpot_ms": {"mean": 10.0}, "identity": {"identical": 2, "n": 2}}
    pld = dict(peer, method="hf-pld", k=7, output_tok_s=16.0, identity={"identical": 1, "n": 2})
    bad = {"ok": False, "n": 3, "identical": 2, "ties": [], "mismatches": [{"request": 0}]}
    runs = [_run("baseline", 0, 1.0, requests=_reqs(1.0, 1.0, 0.1)),          # first two: 20 tokens in 2 s
            _run("eagle3", 1, 1.0, requests=_reqs(0.5, 0.5, 0.01)), _run("eagle3", 3, 1.0, requests=_reqs(0.4, 0.4, 5.0)),
            _run("peagle", 3, 1.0, requests=_reqs(0.25, 0.25, 0.25), identity=bad),
            _run("baseline", 0, 1.0, rep=1, requests=_reqs(0.1, 0.1, 0.1))]
    rows = _lines(peers_md(_res(runs, peers=[peer, pld])))
    assert rows[2] == ("| dataset | engine | prompts | tok/s | ÷ peagle baseline | TTFT ms | TPOT ms | "
                       "same tokens as peagle baseline |")
    assert rows[4:] == ["| HumanEval | HF generate | 2 | 8.0 | 0.80× | 100 | 10.0 | 2/2 |",
                        "| HumanEval | HF prompt lookup (prompt_lookup_num_tokens=7) | 2 | 16.0 | 1.60× | 100 | 10.0 | 1/2 |",
                        "| HumanEval | peagle baseline | 2 | 10.0 | 1.00× | 100 | 10.0 | reference/2 |",
                        "| HumanEval | peagle EAGLE-3 (K=3) | 2 | 25.0 | 2.50× | 100 | 10.0 | 2/2 |",
                        "| HumanEval | peagle P-EAGLE (K=3) | 2 | 40.0 | 4.00× | 100 | 10.0 | 1/2 |"]


# ------------------------------------------------------------------ losslessness
def _idt(same, n, ties=0, bad=0, ok=True):
    return {"ok": ok, "n": n, "identical": same, "ties": [{"request": 0}] * ties, "mismatches": [{"request": 1}] * bad}


def test_identity_md_adds_up_the_speculative_runs_and_lists_every_divergence():
    """Losslessness line: totals over speculative greedy runs only, ties and mismatches apart, a row per divergent run."""
    runs = [_run("baseline", 0, 1.0, identity=_idt(2, 2)), _run("peagle", 3, 1.0, identity=_idt(1, 2, ties=1)),
            _run("eagle3", 1, 1.0, c=4, identity=_idt(1, 2, bad=1, ok=False)), _run("peagle", 1, 1.0, identity=_idt(2, 2)),
            _run("eagle3", 3, 1.0, identity={"ok": None, "note": "sampling"})]
    md = identity_md(_res(runs))
    assert "**4/6 identical**, 1 divergences at floating-point ties" in md and "**1 real mismatches**" in md
    rows = _lines(md)
    assert rows[-2:] == ["| humaneval | peagle | 3 | 1 | 1 | 2 | 1 | 0 |", "| humaneval | eagle3 | 1 | 4 | 1 | 2 | 0 | 1 |"]
    sampled = [_run("peagle", 3, 1.0, identity={"ok": None, "note": "sampling"})]
    assert identity_md(_res(sampled)) == "(sampling run: no greedy identity check)"


# ------------------------------------------------------------------ online, all runs
def test_online_md_shows_the_online_figures_and_counts_request_errors():
    """The online section shows the online runs' figures (not the offline ones) and counts request errors."""
    off = [_run("baseline", 0, 100.0), _run("peagle", 3, 300.0)]
    on = [_run("baseline", 0, 80.0), _run("peagle", 3, 120.0, errors=["timeout", "reset"]),
          _run("eagle3", 3, 100.0, errors=[])]
    md = online_md(_res(off, online_runs=on))
    assert "3 runs, 2 request errors" in md
    assert "| 1 | 80.0 | 100.0 (K=3, AL 1.50) | 120.0 (K=3, AL 1.50) | 1.20× | 1.50× | 1.25× |" in md


def test_runs_md_lists_each_run_under_its_columns():
    """The all-runs table puts c, repeat, wall time, tokens/s and paced tokens/s each under its own header (paced:
    a baseline of 20 tok/s at t=0 and 10 at t=2 is 17.5 at t=0.5, its median 15: 10 x 15 / 17.5)."""
    runs = [_run("baseline", 0, 20.0, c=4, rep=1, t_mid=0.0), _run("peagle", 3, 10.0, c=4, rep=1, wall_s=2.5, t_mid=0.5),
            _run("baseline", 0, 10.0, c=4, rep=1, t_mid=2.0)]
    rows = _lines(runs_md(_res(runs)))
    assert rows[0].startswith("| dataset | method | K | c | rep | reqs | out tok | wall s | tok/s | paced tok/s | TTFT ms |")
    assert rows[3] == "| humaneval | peagle | 3 | 4 | 1 | 2 | 20 | 2.5 | 10.0 | 8.6 | 10 | 2.0 | 1.50 | 1.00 | 4.00 | 2/2 |"


def test_report_md_says_how_its_tokens_per_second_are_paced():
    """With run times: the pacing and where the baseline ran (--ref-every); without: raw medians."""
    res = _full(ref_every=4)
    assert "Tokens/s are medians over repeats as measured" in report_md(res, [])
    for r in res["runs"]:
        r["t_mid"] = 1.0
    md = report_md(res, [])
    assert "at the baseline's pace" in md and "first, after every 4 runs and last" in md
    assert "adjacent in time" not in md                      # one baseline run: no neighbour to compare
    res["runs"].append(dict(res["runs"][0], output_tok_s=80.0, t_mid=2.0))
    assert "differed by a median of 20.0 % (HumanEval) at c=1" in report_md(res, [])
    res["runs"].pop()
    assert "which runs first)" in report_md(dict(res, meta=dict(res["meta"], settings=dict(
        res["meta"]["settings"], ref_every=0))), [])


# ------------------------------------------------------------------ the whole page
def _full(**settings):
    st = {"temperature": 0.0, "draft_sampling": "argmax", "output_len": 16, "ignore_eos": False, "ks": [3],
          "concurrency": [1], "repeats": 1}
    st.update(settings)
    meta = {"command": "peagle bench --ks 3", "started_utc": "2024-01-01T00:00:00Z", "finished_utc": "2024-01-01T00:02:00Z",
            "duration_s": 120.0, "model": "/m/tiny", "heads": {"eagle3": None, "peagle": "/h/pe"},
            "machine": {"cpu": "CPU", "cores": 2, "torch_threads": 1, "mem_gib": 1.0, "loadavg_at_start": None},
            "versions": {"python": "3", "torch": "2", "transformers": "4", "peagle_commit": "abcdef1234567",
                         "peagle_dirty": False}, "settings": st}
    smp = [{"id": f"he-{i}", "category": "code", "output": f"SAMPLE-{i}"} for i in range(3)]
    ds = {"humaneval": {"n_prompts": 3, "n_skipped_too_long": 0, "kinds": ["raw"], "prompt_tokens_mean": 5.0,
                        "categories": {"code": 3}, "samples": smp}}
    runs = [_run("baseline", 0, 100.0, al=1.0), _run("peagle", 3, 250.0)]
    return {"meta": meta, "datasets": ds, "runs": runs, "peers": []}


def test_report_md_states_the_runs_settings_as_they_were():
    """Settings line: minutes, EOS, sampled drafts, dirty and partial markers only when so; two samples per dataset."""
    res = _full()
    md = report_md(res, [])
    assert "(2.0 min)" in md and "peagle abcdef1234." in md and "(stops at EOS)" in md
    assert "PARTIAL" not in md and "(dirty)" not in md and "drafter's q" not in md
    assert "SAMPLE-0" in md and "SAMPLE-1" in md and "SAMPLE-2" not in md
    assert "## Online" not in md and "Offline through peagle's engine" in md
    res = _full(ignore_eos=True, draft_sampling="sample", temperature=0.0)
    res["meta"]["versions"]["peagle_dirty"] = True
    md = report_md(dict(res, partial=True), [])
    assert "(ignore EOS)" in md and "peagle abcdef1234 (dirty)." in md and "drafter's q" not in md
    assert "**PARTIAL RESULTS" in md
    assert "(drafts sampled from the drafter's q)" in report_md(_full(draft_sampling="sample", temperature=0.7), [])


def test_report_md_has_an_online_section_only_beside_offline_runs():
    """An online section only beside offline runs; an online-only sweep's online runs are the main figures."""
    res = _full()
    res["online_runs"] = [_run("baseline", 0, 80.0, al=1.0), _run("peagle", 3, 90.0)]
    assert "## Online: through the server" in report_md(res, [])
    only = dict(res, runs=[])
    md = report_md(only, [])
    assert "## Online: through the server" not in md and "Online through `peagle serve`" in md


def test_a_bad_notes_file_leaves_the_earlier_report_in_place(tmp_path):
    """write_all reads --notes before opening report.md: a bad notes path leaves the earlier report.md intact."""
    (tmp_path / "report.md").write_text("earlier")
    with pytest.raises(PeagleError, match="--notes"):
        write_all(_full(), str(tmp_path), str(tmp_path / "missing.md"))
    assert (tmp_path / "report.md").read_text() == "earlier"
