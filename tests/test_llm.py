"""peagle/llm.py: LLM.with_speculative_config builds a second engine on the same loaded target -- the target is
not loaded again, the first LLM is unchanged, and the new one drafts and decodes exactly as an LLM built from
scratch with that config (same tokens, same drafts and acceptances), which is plain decoding's output."""
import os

import pytest

from peagle import LLM, SamplingParams
from peagle.errors import PeagleError
from peagle.llm import DEMO_PEAGLE_HEAD, DEMO_TARGET

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_PEAGLE_HEAD, "config.json")),
                                reason="shipped heads not built")
CFG = {"method": "eagle3", "model": DEMO_PEAGLE_HEAD, "num_speculative_tokens": 3, "parallel_drafting": True}


def _run(llm, prompts):
    llm.reset_metrics()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    m = llm.get_metrics()
    return [o.outputs[0].token_ids for o in outs], (m["num_drafts"], m["num_accepted_tokens"])


def test_shares_the_target_and_decodes_like_a_fresh_llm():
    base = LLM(DEMO_TARGET)
    prompts = [base.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Write a haiku about rivers.", "What is a tuple?")]
    shared = base.with_speculative_config(CFG)
    assert shared.engine.target is base.engine.target
    assert shared.engine.proposer is not None and base.engine.proposer is None     # the first LLM is unchanged
    plain, _ = _run(base, prompts)
    got, counts = _run(shared, prompts)
    fresh, fresh_counts = _run(LLM(DEMO_TARGET, speculative_config=CFG), prompts)
    assert counts[0] > 0                                   # it drafted: a plain engine would fail here
    assert got == fresh == plain
    assert counts == fresh_counts
    back, _ = _run(shared.with_speculative_config(None), prompts)
    assert back == plain


def test_a_bad_config_is_refused():
    base = LLM(DEMO_TARGET)
    with pytest.raises(PeagleError):
        base.with_speculative_config({"method": "eagle3", "num_speculative_tokens": 3})   # no head


def test_a_bad_prompt_queues_none_of_the_call_and_no_rows_is_refused():
    llm = LLM(DEMO_TARGET)
    with pytest.raises(PeagleError, match="prompt is empty"):
        llm.generate(["hello there", ""], SamplingParams(temperature=0, max_tokens=4))
    assert not llm.engine.has_unfinished()                 # "hello there" was not left queued for the next call
    assert len(llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4))) == 1
    with pytest.raises(PeagleError, match="max_num_seqs must be at least 1"):
        LLM(DEMO_TARGET, max_num_seqs=0)                   # it would never admit a request (generate hung)


def test_stop_strings_need_a_tokenizer_and_max_model_len_is_checked(tiny_dirs):
    llm = LLM(tiny_dirs["llama"])                          # no tokenizer
    with pytest.raises(PeagleError, match="tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(stop=["x"], max_tokens=3))
    assert not llm.engine.has_unfinished()                 # the LLM stays usable
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))) == 1
    for bad in (0, -5, "100"):
        with pytest.raises(PeagleError, match="max_model_len"):
            LLM(tiny_dirs["llama"], max_model_len=bad)


def test_chat_checks_its_conversations():
    llm = LLM(DEMO_TARGET)
    for bad in ([], {"role": "user", "content": "hi"}, "Hello", None, [{"role": "user"}], [[]]):
        with pytest.raises(PeagleError, match="conversation"):
            llm.chat(bad)
    assert not llm.engine.has_unfinished()


def test_an_interrupted_generate_leaves_nothing_for_the_next_call(tiny_dirs, monkeypatch):
    """A Ctrl-C (or an error) inside generate left its requests running: the next call stepped them to their
    end first (a thousand steps for max_tokens=None) and threw their outputs away. They are aborted now."""
    llm = LLM(tiny_dirs["llama"], max_num_seqs=2)
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    real, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real()
    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, sp)
    assert not llm.engine.has_unfinished()
    monkeypatch.setattr(llm.engine, "step", real)
    small = SamplingParams(temperature=0, max_tokens=5)
    got = llm.generate([{"prompt_token_ids": [9, 10]}], small)[0].outputs[0].token_ids
    assert got == LLM(tiny_dirs["llama"]).generate([{"prompt_token_ids": [9, 10]}], small)[0].outputs[0].token_ids


def test_a_ctrl_c_in_the_drafters_prefill_leaves_the_engine_whole(monkeypatch):
    """A Ctrl-C while the drafter took in newly admitted rows (after the engine had made them running) left them
    running without drafter rows: generate's abort then raised IndexError instead of KeyboardInterrupt, and the
    next call decoded a request twice over. Now they leave, and the next call decodes as a fresh LLM does."""
    spec = {"method": "eagle3", "model": DEMO_PEAGLE_HEAD, "num_speculative_tokens": 3, "parallel_drafting": True}
    llm = LLM(DEMO_TARGET, speculative_config=spec, max_num_seqs=4)
    real, hit = llm.engine.proposer.add_requests, []

    def ctrl_c(*a, **kw):
        if not hit:
            hit.append(1)
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(llm.engine.proposer, "add_requests", ctrl_c)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], sp)
    assert not llm.engine.running and not llm.engine.waiting
    got = llm.generate([{"prompt_token_ids": [9, 10]}], sp)[0].outputs[0].token_ids
    assert got == LLM(DEMO_TARGET).generate([{"prompt_token_ids": [9, 10]}], sp)[0].outputs[0].token_ids


def test_token_id_prompts_as_tuples_or_numpy_ints(tiny_dirs):
    """A tuple of ids, or numpy ints, were refused ("a prompt must be ... got int64"); both are token ids."""
    import numpy as np
    llm = LLM(tiny_dirs["llama"])
    sp = SamplingParams(temperature=0, max_tokens=3)
    want = llm.generate([5, 6, 7], sp)[0].outputs[0].token_ids
    assert llm.generate((5, 6, 7), sp)[0].outputs[0].token_ids == want
    assert llm.generate(list(np.array([5, 6, 7])), sp)[0].outputs[0].token_ids == want
    assert llm.generate([{"prompt_token_ids": np.array([5, 6, 7]).tolist()}], sp)[0].outputs[0].token_ids == want


def test_what_ended_an_output_is_left_out_of_its_text_and_named_as_in_vllm():
    """A stop token that is not special (a stop_token_ids entry) kept its text in the output: vLLM's detokenizer
    leaves the token that stopped the request out and names it in stop_reason (a stop string: the string; EOS:
    None). Also through P-EAGLE, where the stop token can arrive mid-step."""
    base = LLM(DEMO_TARGET)
    tok = base.get_tokenizer()
    prompt = "def fibonacci(n):\n"
    free = base.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    t = next(i for i in free.token_ids[3:] if i not in tok.all_special_ids and tok.decode([i]).strip())
    cut = free.token_ids.index(t) + 1
    for llm in (base, LLM(DEMO_TARGET, speculative_config=CFG)):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                  stop_token_ids=[t]))[0].outputs[0]
        assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop" and out.stop_reason == t
        assert out.text == tok.decode(free.token_ids[:cut - 1], skip_special_tokens=True)
        s = tok.decode(free.token_ids, skip_special_tokens=True)[5:9]
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s]))[0]
        assert out.outputs[0].stop_reason == s and out.outputs[0].finish_reason == "stop"
    assert free.stop_reason is None


def test_an_output_stops_at_the_context():
    """max_tokens None: the output runs to the context and finishes with "length" there (no test covered the
    engine's cap: removing it went unnoticed; a mutation review)."""
    for cfg in (None, CFG):
        e = LLM(DEMO_TARGET, max_model_len=32, speculative_config=cfg).engine
        r = e.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
        for _ in range(40):                                # steps, bounded: without the cap it never ends
            if not e.has_unfinished():
                break
            e.step()
        assert r.finished and len(r.output_ids) == 32 - 5 and r.finish_reason == "length", len(r.output_ids)


def test_prefill_admits_by_its_token_budget_and_an_aborted_waiting_id_is_free_again():
    """A mutation review: a budget that counted prompts instead of tokens, and an abort of a waiting request that
    kept its id in use, passed every test."""
    e = LLM(DEMO_TARGET, max_num_seqs=8).engine
    e.prefill_token_budget = 10
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        e.add_request(f"r{i}", list(range(5, 13)), sp)          # 8 tokens each: one per step fits 10
    e.step()
    assert len(e.running) == 1 and len(e.waiting) == 2
    assert e.abort("r2") and not e.abort("r2")
    e.add_request("r2", [5, 6], sp)                              # the aborted id can be used again
    while e.has_unfinished():
        e.step()
    assert not e._live


def test_a_requests_mean_acceptance_length_counts_the_bonus_token():
    """A request's metrics use vLLM's definition, 1 + accepted / drafts (the target's own token each step): for a
    lone request it equals the engine's mean_acceptance_length."""
    llm = LLM(DEMO_TARGET, speculative_config=CFG)
    out = llm.generate("def fibonacci(n):\n", SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    m, g = out.metrics, llm.get_metrics()
    assert m["num_drafts"] == g["num_drafts"] > 0 and m["num_accepted_tokens"] == g["num_accepted_tokens"] > 0
    assert abs(m["mean_acceptance_length"] - g["mean_acceptance_length"]) < 1e-9
    assert m["mean_acceptance_length"] > 1


def test_a_sampling_params_list_of_another_length_and_unknown_arguments_are_refused(tiny_dirs):
    """zip() would drop the prompts past the list's end (fewer outputs than prompts, silently); an unknown LLM
    argument (vLLM's tensor_parallel_size, a misspelt max_num_seqs) would be ignored."""
    llm = LLM(tiny_dirs["llama"])
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(PeagleError, match="as long as prompts"):
        llm.generate([[5, 6], [7, 8], [9, 10]], [sp, sp])
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[5, 6], [7, 8]], [sp, sp])) == 2
    with pytest.raises(PeagleError, match="unsupported LLM argument.*max_num_seq"):
        LLM(tiny_dirs["llama"], max_num_seq=4)


def test_a_text_prompt_gets_the_tokenizers_special_tokens(tiny_dirs, tmp_path):
    """As vLLM encodes a text prompt: tokenizer(prompt) with its special tokens (a Llama tokenizer's BOS)."""
    import shutil

    from tiny import make_tiny_tokenizer
    from tokenizers import processors
    d = str(tmp_path / "m")
    shutil.copytree(tiny_dirs["llama"], d)
    tok = make_tiny_tokenizer(d)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save_pretrained(d)
    llm = LLM(d)
    want = llm.get_tokenizer()("def add(a, b):")["input_ids"]
    assert want[0] == 1
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_token_ids == want


def test_head_notes_say_what_the_head_was_not_trained_for():
    """A static K past the head's trained depth and a P-EAGLE head without parallel_drafting ran without a word
    (drafts past the depth are rarely accepted; the head then drafts autoregressively). Within its depth, as
    configured, or with K auto: no note."""
    from peagle.autok.factory import trained_depth
    from peagle.heads.io import load_head_dir
    from peagle.llm import head_notes
    from peagle.spec_config import parse_spec_config
    cfg, _ = load_head_dir(DEMO_PEAGLE_HEAD)
    depth = trained_depth(cfg)

    def notes(**kw):
        spec = parse_spec_config(dict(CFG, **kw))
        return head_notes(spec, cfg, depth + 4 if spec.auto else spec.num_speculative_tokens)
    assert notes() == [] and notes(num_speculative_tokens=depth) == []
    assert notes(num_speculative_tokens="auto") == []
    (n,) = notes(num_speculative_tokens=depth + 1)
    assert f"num_speculative_tokens {depth + 1} is above the head's trained depth ({depth})" in n
    (n,) = notes(parallel_drafting=False)
    assert "P-EAGLE head" in n and "drafts autoregressively" in n


def test_head_notes_are_said_once_per_process(capsys):
    """A bench builds an engine per dataset, concurrency and repeat: the same note is printed once."""
    import peagle.llm as L
    L._SAID.clear()
    base = LLM(DEMO_TARGET)
    cfg = dict(CFG, parallel_drafting=False)
    capsys.readouterr()
    base.with_speculative_config(cfg)
    base.with_speculative_config(cfg)
    assert capsys.readouterr().err.count("drafts autoregressively") == 1
