"""The engine's typed step errors: a failed prefill names (and drops) only the requests it was admitting and
leaves the running ones exact; a failed decode step names the running requests."""
import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.errors import DecodeError, PeagleError, PrefillError

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_prefill_error_names_new_requests_and_running_ones_stay_exact(target):
    want = LLM(target).generate([[5, 6, 7]], SP)[0].outputs[0].token_ids
    e = LLM(target).engine
    a = e.add_request("a", [5, 6, 7], SP)
    e.step()
    orig = e.target.forward

    def poisoned(toks, *args, **kw):
        if kw.get("logits_at") is not None:
            raise RuntimeError("poisoned prefill")
        return orig(toks, *args, **kw)
    e.target.forward = poisoned
    e.add_request("b", [8, 9], SP)
    e.add_request("c", [10, 11, 12], SP)
    with pytest.raises(PrefillError) as ei:
        e.step()
    assert ei.value.request_ids == ["b", "c"] and "poisoned prefill" in str(ei.value.__cause__)
    assert [r.request_id for r in e.running] == ["a"] and not e.waiting
    del e.target.forward
    while e.has_unfinished():
        e.step()
    assert a.output_ids == want


def test_decode_error_names_the_running_requests(target):
    e = LLM(target).engine
    for rid in ("a", "b"):
        e.add_request(rid, [5, 6, 7], SP)
    e.step()
    lens = e.cache.lens[:2].clone()
    e.target.forward = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("decode blew up"))
    with pytest.raises(DecodeError) as ei:
        e.step()
    assert sorted(ei.value.request_ids) == ["a", "b"]
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert torch.equal(e.cache.lens[:2], lens)          # the step failed before changing any length


def test_abort_finishes_a_waiting_request_like_a_running_one(target):
    """A request aborted while waiting stayed unfinished with no reason; a running one ended as 'abort'."""
    eng = LLM(target, max_num_seqs=1).engine
    sp = SamplingParams(temperature=0, max_tokens=8)
    run, wait = eng.add_request("a", [5, 6], sp), eng.add_request("b", [7, 8], sp)
    eng.step()
    assert run in eng.running and wait in eng.waiting
    assert eng.abort("b") and eng.abort("a") and not eng.has_unfinished()
    assert [(r.finished, r.finish_reason) for r in (run, wait)] == [(True, "abort")] * 2
    assert wait.finish_time is not None and run.finish_time is not None


def test_a_request_id_in_use_is_refused(target):
    """Two requests under one id: abort removed the first match and auto K's per-request statistics mixed them.
    A finished request's id may be used again."""
    e = LLM(target).engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    e.add_request("a", [5, 6], sp)
    with pytest.raises(PeagleError, match="already in use"):
        e.add_request("a", [7, 8], sp)
    e.step()                                         # running now
    with pytest.raises(PeagleError, match="already in use"):
        e.add_request("a", [7, 8], sp)
    while e.has_unfinished():
        e.step()
    e.add_request("a", [7, 8], sp)


def test_an_idle_engine_gives_its_cache_memory_back_and_decodes_the_same():
    """The KV caches grew with the largest batch and longest row and never shrank (a server held 1.4 GB after
    one long request at 16 rows in a probe). release_memory() on an idle engine returns both caches to one row
    of their initial length and drops the drafter's backlog; outputs afterwards equal a fresh engine's.
    Negative control: it refuses while a request runs."""
    from peagle.llm import DEMO_PEAGLE_HEAD, DEMO_TARGET
    spec = {"method": "eagle3", "model": DEMO_PEAGLE_HEAD, "num_speculative_tokens": 3, "parallel_drafting": True}
    llm = LLM(DEMO_TARGET, speculative_config=spec, max_num_seqs=8)
    e = llm.engine
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(6)], long)
    assert e.cache.rows >= 6 and e.cache.cap > 256
    e.add_request("busy", [5, 6], SP)
    assert not e.release_memory()
    while e.has_unfinished():
        e.step()
    assert e.release_memory()
    assert (e.cache.rows, e.cache.cap) == (1, 256) and e.cache.k[0].shape[0] == 1 and e.proposer.context is None
    assert (e.proposer.cache.rows, e.proposer.cache.cap) == (1, 256)
    ps = [{"prompt_token_ids": [9, 10, 11]}, {"prompt_token_ids": [12, 13]}]
    got = [o.outputs[0].token_ids for o in llm.generate(ps, long)]
    fresh = LLM(DEMO_TARGET, speculative_config=spec, max_num_seqs=8)
    assert got == [o.outputs[0].token_ids for o in fresh.generate(ps, long)]
