"""The sweep's choices, on a stand-in for Bench that records each run instead of running it: which (method, K)
runs and in what order (baseline first, the rest alternating direction per repeat and concurrency), the warm-up,
which prompts are kept and how batches fill c, which baseline output every other run (and the HF peers, and
the online runs) is checked against, the samples, MT-Bench's second turns and when partial results are
written. Each test here was written against a mutant of peagle/bench/sweep.py that the end-to-end bench tests
let through (a mutation review): the order never alternated, a later repeat's baseline became the reference,
the peers were checked against the largest concurrency, a prompt as long as --max-prompt-len was skipped, ..."""
import types

import pytest
import torch

from peagle.bench import sweep
from peagle.bench.command import apply_defaults
from peagle.bench.runner import Bench
from peagle.cli import build_parser
from peagle.data.benchmarks import Prompt


def _same(method, k, c, nth, ids):
    """Every engine's output: the prompt's last two tokens (all runs identical)."""
    return ids[-2:]


class _Bench:
    """Bench as run_sweep uses it: a prompt's ids are its characters; run() records (method, K, c, batch,
    max_tokens, max_model_len) and each request's output is answer(method, K, c, nth, prompt ids), nth counting
    that (method, K, c, max_tokens)'s runs from 0 ("online" for a server's); identity is Bench's own, with every
    divergence a real mismatch."""
    answer = staticmethod(_same)
    quantization = "none"
    kv_cache_dtype = "auto"

    def __init__(self, model, heads, dtype, seed, max_batch, *args, **kw):
        self.heads_dirs, self.max_batch, self.backend = heads, max_batch, "auto"
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.target = types.SimpleNamespace(precision="float32")
        self.costs, self.calls, self.n = {}, [], {}
        _Bench.last = self

    def head(self, method):
        return types.SimpleNamespace(cfg={"num_hidden_layers": 1, "hidden_size": 8})

    def encode(self, p):
        return [ord(ch) for ch in (p.text if p.kind == "raw" else "|".join(m["content"] for m in p.messages))]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def top2_gap(self, ids):
        return 10.0, 1e-3

    identity = Bench.identity

    def run(self, method, k, c, batch, params, mlen):
        self.calls.append({"method": method, "k": k, "c": c, "batch": [list(x) for x in batch],
                           "max_tokens": params.max_tokens, "mlen": mlen})
        key = (method, k, c, params.max_tokens)
        nth = self.n[key] = self.n.get(key, -1) + 1
        return dict(_figures(method, k, c, batch), _outputs=[self.answer(method, k, c, nth, x) for x in batch])


def _figures(method, k, c, batch):
    return {"method": method, "k": k, "concurrency": c, "n_requests": len(batch), "output_tok_s": 1.0, "wall_s": 1.0,
            "metrics": {"mean_acceptance_length": 1.0}, "ttft_ms": {"mean": 1.0}, "tpot_ms": {"mean": 1.0},
            "timing": {"draft_ms_per_step": 0.0, "verify_ms_per_step": 0.0}, "errors": []}


class _Peer:
    """HFPeer: records (name, prompt ids, pld); its outputs are what the answer rule gives at c=1."""
    calls: list = []

    def __init__(self, model, dtype, device):
        pass

    def run(self, name, ids, n, ignore_eos, temperature, pld=0):
        _Peer.calls.append((name, [list(x) for x in ids], pld))
        return dict(_figures(name, pld, 1, ids), _outputs=[_Bench.answer(name, pld, 1, 0, x) for x in ids])


class _Server:
    """OnlineServer: a context manager with a url."""

    def __init__(self, model, method, k, *args):
        self.url = f"http://{method}-{k}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_online(srv, method, k, c, batch, max_tokens, temperature=0.0, ignore_eos=False):
    return dict(_figures(method, k, c, batch), _outputs=[_Bench.answer(method, k, c, "online", x) for x in batch])


def _chat(pid, text, second=None):
    return Prompt("mtbench", "writing", pid, "chat", messages=[{"role": "user", "content": text}], second_turn=second)


DATA = {"humaneval": [Prompt("humaneval", "code", f"he-{i}", "raw", text=t)
                      for i, t in enumerate(("abcd", "efgh", "ijkl", "mnop"))],
        "mtbench": [_chat("m0", "ab", "cd"), _chat("m1", "efg"), _chat("m2", "hi", "jk")]}


@pytest.fixture
def bench_sweep(monkeypatch):
    """run_sweep(flags...) on the stand-ins; returns (results, the bench, the log lines)."""
    monkeypatch.setattr(sweep, "Bench", _Bench)
    monkeypatch.setattr(sweep, "HFPeer", _Peer)
    monkeypatch.setattr(sweep, "OnlineServer", _Server)
    monkeypatch.setattr(sweep, "run_online", _run_online)
    monkeypatch.setattr(_Peer, "calls", [])

    def go(*flags, data=DATA, answer=_same, on_dataset=None):
        a = build_parser("bench").parse_args(["bench", "--datasets", "humaneval", "--ks", "3", "--concurrency", "1",
                                              "--output-len", "5", "--peers", "", "--quantization", "none", *flags])
        apply_defaults(a)
        a.command = "peagle bench"
        monkeypatch.setattr(_Bench, "answer", staticmethod(answer))
        monkeypatch.setattr(sweep, "load_dataset", lambda name, n=None, *rest: data[name][:n] if n else data[name])
        logs = []
        res = sweep.run_sweep(a, log=logs.append, on_dataset=on_dataset)
        return res, _Bench.last, logs
    return go


def _timed(bench):
    """The runs that are not warm-ups (8 tokens)."""
    return [x for x in bench.calls if x["max_tokens"] != 8]


# ------------------------------------------------------------------ what runs, in what order
def test_configs_are_baseline_then_each_drafters_chains_then_its_trees():
    """Run list: baseline, then per drafter (EAGLE-3 first) its chains over K, then its trees (tree by tree, K inside)."""
    assert sweep.configs(["peagle", "eagle3", "baseline"], [1, 3], ["4x8", "8x16"]) == [
        ("baseline", 0), ("eagle3", 1), ("eagle3", 3), ("eagle3+tree4x8", 1), ("eagle3+tree4x8", 3),
        ("eagle3+tree8x16", 1), ("eagle3+tree8x16", 3), ("peagle", 1), ("peagle", 3), ("peagle+tree4x8", 1),
        ("peagle+tree4x8", 3), ("peagle+tree8x16", 1), ("peagle+tree8x16", 3)]
    assert sweep.configs(["peagle"], [3]) == [("peagle", 3)]


def test_repeats_alternate_direction_per_repeat_and_concurrency_after_the_baseline(bench_sweep):
    """Baseline first, the rest alternating direction per (c index + repeat); repeats recorded; warm-ups; max c
    (--ref-every 0: the baseline once per repeat)."""
    res, bench, _ = bench_sweep("--methods", "baseline,eagle3,peagle", "--ks", "1,3", "--concurrency", "1,2",
                                "--repeats", "2", "--ref-every", "0")
    fwd = [("baseline", 0), ("eagle3", 1), ("eagle3", 3), ("peagle", 1), ("peagle", 3)]
    back = fwd[:1] + fwd[:0:-1]
    want = [(m, k, c, rep) for c, rep, order in ((1, 0, fwd), (1, 1, back), (2, 0, back), (2, 1, fwd))
            for m, k in order]
    assert [(r["method"], r["k"], r["concurrency"], r["repeat"]) for r in res["runs"]] == want
    warm = [x for x in bench.calls if x["max_tokens"] == 8]
    assert [(x["method"], x["k"], x["c"]) for x in warm] == [(m, k, 1) for m, k in fwd]
    assert bench.calls[:len(warm)] == warm and bench.max_batch == 2


def test_baseline_again_after_every_ref_every_runs_and_at_the_end_of_each_repeat(bench_sweep, monkeypatch):
    """--ref-every 2: in each repeat (directions still alternating) the baseline runs first, after every two
    other runs and last, so every run has baselines close in time; each run records its midpoint (its end less
    half its wall time, from the sweep's start: here a clock that ticks 1 s per reading, runs of 1 s)."""
    ticks = iter(range(1000))
    monkeypatch.setattr(sweep, "time", types.SimpleNamespace(time=lambda: 0.0, perf_counter=lambda: float(next(ticks))))
    res, _, _ = bench_sweep("--methods", "baseline,eagle3,peagle", "--ks", "1,3,5", "--repeats", "2",
                            "--ref-every", "2")
    b, e, p = "baseline", "eagle3", "peagle"
    fwd = [(e, 1), (e, 3), (e, 5), (p, 1), (p, 3), (p, 5)]
    want = [(b, 0, 0), *[(m, k, 0) for m, k in fwd[:2]], (b, 0, 0), *[(m, k, 0) for m, k in fwd[2:4]], (b, 0, 0),
            *[(m, k, 0) for m, k in fwd[4:]], (b, 0, 0),
            (b, 0, 1), *[(m, k, 1) for m, k in fwd[:3:-1]], (b, 0, 1), *[(m, k, 1) for m, k in fwd[3:1:-1]], (b, 0, 1),
            *[(m, k, 1) for m, k in fwd[1::-1]], (b, 0, 1)]
    assert [(r["method"], r["k"], r["repeat"]) for r in res["runs"]] == want
    assert [r["t_mid"] for r in res["runs"]] == [i + 0.5 for i in range(len(want))]
    assert sweep.run_order([(b, 0), (e, 1), (e, 3)], False, 5) == [(b, 0), (e, 1), (e, 3), (b, 0)]


def test_baseline_runs_even_when_not_asked_for(bench_sweep):
    """--methods peagle still runs the baseline first (identity reference, speedups), and again after it (the
    reference in time, --ref-every); only P-EAGLE's head described."""
    res, _, _ = bench_sweep("--methods", "peagle")
    assert [r["method"] for r in res["runs"]] == ["baseline", "peagle", "baseline"]
    assert list(res["meta"]["head_configs"]) == ["peagle"]


# ------------------------------------------------------------------ prompts and batches
def test_prompts_longer_than_max_prompt_len_are_skipped_and_counted(bench_sweep):
    """A prompt of exactly --max-prompt-len is kept, a longer one skipped and counted; max_model_len from the kept."""
    data = dict(DATA, humaneval=[Prompt("humaneval", "x", "he-0", "raw", text="abcd"),
                                 Prompt("humaneval", "y", "he-1", "raw", text="abcde"),
                                 Prompt("humaneval", "x", "he-2", "raw", text="abcdef")])
    res, bench, _ = bench_sweep("--max-prompt-len", "5", data=data)
    d = res["datasets"]["humaneval"]
    assert (d["n_prompts"], d["n_skipped_too_long"], d["ids"]) == (2, 1, ["he-0", "he-1"])
    assert d["categories"] == {"x": 1, "y": 1} and d["categories_per_prompt"] == ["x", "y"]
    assert d["prompt_tokens_mean"] == pytest.approx(4.5) and d["max_model_len"] == 5 + 5 + 8
    assert all(x["mlen"] == 18 and len(x["batch"]) == 2 for x in _timed(bench))


def test_a_concurrency_above_the_prompt_count_repeats_prompts_unless_told_not_to(bench_sweep):
    """c above the prompt count repeats prompts in turn to fill c; --no-fill-concurrency sends each prompt once."""
    data = dict(DATA, humaneval=DATA["humaneval"][:2])
    ab, ef = [ord(x) for x in "abcd"], [ord(x) for x in "efgh"]
    for flag, want in (("--fill-concurrency", [ab, ef, ab]), ("--no-fill-concurrency", [ab, ef])):
        res, bench, _ = bench_sweep("--concurrency", "1,3", flag, "--ref-every", "0", data=data)
        assert [x["batch"] for x in _timed(bench) if x["c"] == 3] == [want] * 3     # 3 configs
        assert [r["n_requests"] for r in res["runs"] if r["concurrency"] == 3] == [len(want)] * 3


# ------------------------------------------------------------------ the identity reference
def test_the_first_baselines_outputs_are_the_reference_for_every_repeat(bench_sweep):
    """Repeat 0's baseline is the identity reference for later repeats (and the samples); mismatch len is [run, ref]."""
    def answer(method, k, c, nth, ids):
        return ids[-1:] if (method, nth) == ("baseline", 1) else ids[-2:]
    res, _, _ = bench_sweep("--methods", "baseline,peagle", "--repeats", "2", "--num-prompts", "2", "--ref-every", "0",
                            answer=answer)
    idt = {(r["method"], r["repeat"]): r["identity"] for r in res["runs"]}
    assert idt[("baseline", 0)]["identical"] == 2 and idt[("peagle", 0)]["identical"] == 2
    assert idt[("baseline", 1)]["identical"] == 0 and idt[("baseline", 1)]["mismatches"][0]["len"] == [1, 2]
    assert idt[("peagle", 1)]["identical"] == 2 and idt[("peagle", 1)]["ok"] is True
    assert [x["output"] for x in res["datasets"]["humaneval"]["samples"]] == ["cd", "gh"]


def test_samples_and_peers_use_the_lowest_concurrencys_baseline(bench_sweep):
    """Samples and the HF peers' reference are the lowest c's baseline; peers get --peer-prompts, --pld-tokens, their names."""
    res, _, _ = bench_sweep("--concurrency", "2,1", "--peers", "hf-pld", "--peer-prompts", "2", "--pld-tokens", "7",
                            answer=lambda m, k, c, nth, ids: ids[-2:] + [c])
    smp = res["datasets"]["humaneval"]["samples"]
    assert [(x["id"], x["category"], x["output"]) for x in smp] == [("he-0", "code", "cd\x01"), ("he-1", "code", "gh\x01"),
                                                                  ("he-2", "code", "kl\x01")]
    assert _Peer.calls == [("hf-pld", [[ord(x) for x in "abcd"], [ord(x) for x in "efgh"]], 7)]
    (peer,) = res["peers"]
    assert peer["dataset"] == "humaneval" and peer["identity"]["ok"] is True and peer["identity"]["identical"] == 2


def test_a_quantized_target_runs_no_hf_peer(bench_sweep, monkeypatch):
    """A quantized target runs no HF peer (float weights could not match its tokens), and the log says why."""
    monkeypatch.setattr(_Bench, "quantization", "q4")
    res, _, logs = bench_sweep("--peers", "hf")
    assert res["peers"] == [] and _Peer.calls == [] and any("peers hf skipped" in x for x in logs)


def test_a_bfloat16_kv_cache_runs_no_hf_peer(bench_sweep, monkeypatch):
    """A sweep on a bfloat16 KV cache runs no HF peer (transformers' float32 cache could not match its tokens)."""
    monkeypatch.setattr(_Bench, "kv_cache_dtype", "bfloat16")
    res, _, logs = bench_sweep("--peers", "hf")
    assert res["peers"] == [] and _Peer.calls == [] and any("float32 KV cache" in x for x in logs)


# ------------------------------------------------------------------ MT-Bench turn 2
def test_mtbench_second_turns_carry_each_prompts_own_first_answer(bench_sweep):
    """MT-Bench turn 2 adds '<id>-t2' with that prompt's own baseline answer; kept at exactly --max-prompt-len."""
    res, bench, _ = bench_sweep("--datasets", "mtbench", "--mtbench-turns", "2", "--max-prompt-len", "8")
    assert res["datasets"]["mtbench"]["ids"] == ["m0", "m1", "m2", "m0-t2", "m2-t2"]
    batch = _timed(bench)[-1]["batch"]
    assert [bench.decode(x) for x in batch[3:]] == ["ab|ab|cd", "hi|hi|jk"]


# ------------------------------------------------------------------ online
def test_online_runs_are_checked_against_the_offline_baseline(bench_sweep):
    """Online runs are checked against the offline baseline (--mode both), the online baseline only when online-only."""
    def answer(method, k, c, nth, ids):
        return ids[-1:] if (method, nth) == ("baseline", "online") else ids[-2:]
    res, _, _ = bench_sweep("--mode", "both", "--methods", "baseline,peagle", answer=answer)
    on = {r["method"]: r["identity"] for r in res["online_runs"]}
    assert on["baseline"]["identical"] == 0 and on["peagle"]["identical"] == len(DATA["humaneval"])
    res, _, _ = bench_sweep("--mode", "online", "--methods", "baseline,peagle", answer=answer)
    on = {r["method"]: r["identity"] for r in res["online_runs"]}
    assert res["runs"] == [] and on["baseline"]["ok"] is True and on["peagle"]["identical"] == 0


def test_an_online_only_sweep_writes_partial_results_only_after_a_server_ran(bench_sweep):
    """--mode online writes partial results after each server's runs, never before the first online run."""
    seen = []
    bench_sweep("--mode", "online", "--methods", "baseline,peagle", "--datasets", "humaneval,mtbench",
                on_dataset=lambda res: seen.append(len(res.get("online_runs", []))))
    assert seen == [2, 4]
