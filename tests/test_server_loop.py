"""The engine loop (peagle/server/loop.py) runs on the thread that built its engine: the server's HTTP side and the
engine share no thread that enters the target's parallel regions, and outputs stay those of plain decoding."""
import threading

import pytest
from serving import client, head_dir, model_dir, ref_complete, ref_llm, spec_cfg, start  # noqa: F401 (fixtures)

import peagle.server.start as server_start
from peagle.engine import Engine
from peagle.server.loop import EngineThread


def test_engine_steps_on_the_thread_that_built_it(model_dir, head_dir, ref_llm, monkeypatch):
    prompts = ["Hello there", "Once upon a time"]
    want = [o.text for o in ref_complete(ref_llm, prompts, 8)]
    built, stepped = [], set()
    real_build, real_step = server_start.build_engine, Engine.step

    def build(*a, **kw):
        built.append(threading.get_ident())
        return real_build(*a, **kw)

    def step(self):
        stepped.add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(server_start, "build_engine", build)
    monkeypatch.setattr(Engine, "step", step)
    srv = start(model_dir, spec_cfg(head_dir), max_num_seqs=2)
    try:
        got = [client(srv).completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
    finally:
        srv.stop()
    assert got == want
    assert len(built) == 1 and built[0] != threading.main_thread().ident
    assert stepped == {built[0]}


def test_engine_thread_runs_calls_in_order_on_one_daemon_thread():
    t = EngineThread()
    ids = [t.submit(threading.get_ident) for _ in range(3)]
    daemon = t.submit(lambda: threading.current_thread().daemon)   # Ctrl-C during a build does not wait for it
    failed = t.submit(lambda: 1 / 0)
    keyword = t.submit(lambda a, b=0: a + b, 2, b=3)
    t.shutdown()
    assert len({f.result(5) for f in ids}) == 1 and ids[0].result() != threading.get_ident()
    assert daemon.result(5) is True
    with pytest.raises(ZeroDivisionError):
        failed.result(5)
    assert keyword.result(5) == 5


def test_prefill_budget_comes_back_when_the_last_isolated_request_is_aborted(target):
    """After a failed prefill of two requests the loop admits them one per step (budget 0) and restores the
    budget once none is left waiting; an abort of the last one while it waited left the budget at 0 for the
    life of the server. Negative control: while one isolated request still waits, the budget stays 0."""
    import asyncio

    from peagle import LLM, SamplingParams
    from peagle.server.loop import EngineLoop, Handle
    eng = LLM(target, max_num_seqs=4).engine
    lp, aloop = EngineLoop(eng, max_waiting=8), asyncio.new_event_loop()
    budget, orig, calls = eng.prefill_token_budget, eng._prefill_rows, []

    def flaky(new, b0):
        calls.append(len(new))
        if len(calls) == 1:
            raise RuntimeError("transient prefill failure")
        return orig(new, b0)
    eng._prefill_rows = flaky
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid in ("r1", "r2"):
        assert lp.try_reserve()
        lp.submit(Handle(rid, [5, 6, 7, 8], sp, None, aloop))
    lp._drain()
    lp._step()                                      # the failed prefill: both isolated
    lp._step()                                      # r1 admitted alone, r2 still waits
    assert lp._isolate == {"r2"} and eng.prefill_token_budget == 0
    lp.abort("r2")
    lp._drain()
    assert not lp._isolate and eng.prefill_token_budget == budget
    aloop.close()


def test_a_finished_request_counts_as_a_success_where_the_engine_finishes_it(target):
    """vllm:request_success_total was counted by the HTTP handler on reading the final item: a request the
    engine finished while its client was leaving was counted neither there nor as aborted (the loop had
    released it). It counts when the engine finishes it, whether or not anyone reads the item."""
    import asyncio

    from peagle import LLM, SamplingParams
    from peagle.server.loop import EngineLoop, Handle
    from peagle.server.prometheus import ServerMetrics
    eng = LLM(target, max_num_seqs=2).engine
    m = ServerMetrics("tiny")
    lp, aloop = EngineLoop(eng, max_waiting=4, metrics=m), asyncio.new_event_loop()
    assert lp.try_reserve()
    lp.submit(Handle("r1", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), None, aloop))
    lp._drain()
    while eng.has_unfinished():
        lp._step()
    lines = [x for x in m.render().decode().splitlines() if x.startswith("vllm:request_success_total{")]
    assert lines and 'finished_reason="length"' in lines[0] and lines[0].endswith(" 1.0"), lines
    aloop.close()


def test_the_loop_gives_the_caches_back_once_idle(target):
    """The server's engine loop releases the caches' memory once the engine has been idle release_after_s,
    once per idle spell, not while a request runs; a burst that finishes within one pass of the loop (one token
    per request) is a busy spell too (it was not: the caches it grew were kept)."""
    import asyncio

    from peagle import LLM, SamplingParams
    from peagle.server.loop import EngineLoop, Handle
    eng = LLM(target, max_num_seqs=4).engine
    lp = EngineLoop(eng, max_waiting=4, release_after_s=0.0, idle_wait_s=0.001)
    aloop, calls, real = asyncio.new_event_loop(), [], eng.release_memory
    eng.release_memory = lambda: calls.append(1) or real()

    def burst(tag, prompt, max_tokens):
        for i in range(3):
            assert lp.try_reserve()
            lp.submit(Handle(f"{tag}{i}", prompt + [i], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                      ignore_eos=True), None, aloop))
    burst("r", [5, 6, 7], 300)
    while lp._pass() is False and eng.has_unfinished():
        assert not calls
    assert eng.cache.rows >= 3
    for _ in range(3):                               # idle: released once
        lp._pass()
    assert calls == [1] and eng.cache.rows == 1
    burst("s", [5] * 300, 1)
    lp._pass()                                       # admitted, prefilled and finished in this one pass
    assert not eng.has_unfinished() and eng.cache.rows >= 3
    for _ in range(3):
        lp._pass()
    assert calls == [1, 1] and eng.cache.rows == 1
    aloop.close()


def test_capacity_admits_exactly_max_num_seqs_plus_max_waiting():
    """try_reserve: exactly max_num_seqs + max_waiting requests in flight, the next one refused (a 429) until one
    is released (the overload test only checks that some 429s come: one too many admitted passed it)."""
    import types

    from peagle.server.loop import EngineLoop
    eng = types.SimpleNamespace(max_num_seqs=3, prefill_token_budget=8192, k=0)
    loop = EngineLoop(eng, max_waiting=2)
    try:
        assert [loop.try_reserve() for _ in range(6)] == [True] * 5 + [False]
        loop.unreserve()
        assert loop.try_reserve() and not loop.try_reserve()
    finally:
        loop._thread.shutdown()
