"""`peagle serve`: a real uvicorn server on a loopback port, driven by the official openai client.

Greedy outputs must be identical to plain `LLM.generate` / `LLM.chat` (no speculation), with and without a
speculative config, one request at a time and 32 streams at once; the command line resolves its config and
serves. Bad input, disconnects, overload and failures: test_serve_failures.py."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error

import openai
import pytest
from serving import (  # noqa: F401 (fixtures)
    CHATS,
    PROMPTS,
    K,
    client,
    get_json,
    get_text,
    greedy,
    head_dir,
    model_dir,
    plain,
    post,
    ref_complete,
    ref_llm,
    server,
    spec,
    spec_cfg,
    start,
    stream_completion,
    wait_idle,
)

from peagle import SamplingParams
from peagle import client as client_http

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- identity with plain decoding
def test_models_health_metrics(plain):
    assert get_json(plain, "/health") == {"status": "ok"}
    ms = client(plain).models.list().data
    assert [m.id for m in ms] == ["tiny"] and ms[0].model_extra["max_model_len"] == 1024
    client(plain).completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
    wait_idle(plain)
    text = get_text(plain, "/metrics")
    samples = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    # the series a vLLM dashboard reads, by vLLM's exact names (a renamed one went unseen: a mutation review)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "peagle:cache_rows_in_use"):
        assert name in samples, name


def test_completions_identical_to_plain_decoding(server, ref_llm):
    c = client(server)
    refs = ref_complete(ref_llm, PROMPTS[:4], 24)
    for p, ref in zip(PROMPTS[:4], refs):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                 extra_body={"return_token_ids": True})
        ch = r.choices[0]
        assert ch.text == ref.text and ch.model_extra["token_ids"] == ref.token_ids
        assert ch.finish_reason == ref.finish_reason
        n_prompt = len(r.model_extra["prompt_token_ids"])
        assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == n_prompt + len(ref.token_ids)
        text, ids, fin, usage = stream_completion(c, p, 24)
        assert (text, ids, fin) == (ref.text, ref.token_ids, ref.finish_reason)
        assert usage.completion_tokens == len(ref.token_ids) and usage.prompt_tokens == n_prompt
    # a prompt given as token ids
    ids = ref_llm.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == refs[0].text


def test_chat_identical_to_plain_decoding(server, ref_llm):
    c = client(server)
    for conv in CHATS:
        ref = ref_llm.chat(conv, greedy(20))[0].outputs[0]
        r = c.chat.completions.create(model="tiny", messages=conv, max_tokens=20, temperature=0)
        assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(ref_llm.apply_chat_template(conv))
        s = c.chat.completions.create(model="tiny", messages=conv, max_tokens=20, temperature=0, stream=True)
        chunks = list(s)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_strings_seeds_and_metrics(plain, spec, ref_llm):
    c = client(plain)
    full = ref_complete(ref_llm, [PROMPTS[3]], 40, ignore_eos=True)[0]
    # a stop string from the middle of the greedy output (printable chars)
    cands = [full.text[i:i + 2] for i in range(4, len(full.text) - 2) if full.text[i:i + 2].isprintable()
             and "\ufffd" not in full.text[i:i + 2]]
    assert cands, full.text
    stop = cands[len(cands) // 2]
    ref = ref_complete(ref_llm, [PROMPTS[3]], 40, ignore_eos=True, stop=[stop])[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=40, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    text, _, fin, _ = stream_completion(c, PROMPTS[3], 40, stop=[stop], extra_body={"ignore_eos": True})
    assert (text, fin) == (ref.text, "stop")
    # seeded sampling: same as LLM with the same seed, and repeatable
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234)
    want = ref_llm.generate([PROMPTS[1]], sp)[0].outputs[0].text
    for _ in range(2):
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0.9, top_p=0.95,
                                 seed=1234, extra_body={"top_k": 50})
        assert r.choices[0].text == want
    # seeded sampling with speculation (lossless rejection sampling): repeatable too
    cs = client(spec)
    got = [cs.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0.9, seed=99)
           .choices[0].text for _ in range(2)]
    assert got[0] == got[1]
    # spec-decode counters with vLLM's names (the spec server has served requests by now, or does so here)
    cs.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    m = get_text(spec, "/metrics")
    vals = {ln.split(" ")[0]: float(ln.split(" ")[-1]) for ln in m.splitlines() if ln and not ln.startswith("#")}
    drafts = vals['vllm:spec_decode_num_drafts_total{model_name="tiny"}']
    assert drafts > 0 and vals['vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}'] == K * drafts
    per_pos = [vals[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{i}"}}']
               for i in range(K)]
    assert sum(per_pos) == vals['vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}']
    assert get_json(spec, "/debug/engine")["speculative"]["num_speculative_tokens"] == K


# ---------------------------------------------------------------- load (light) with speculation
def test_32_concurrent_streams_with_speculation(spec, ref_llm):
    n, mt = 32, 24
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    refs = ref_complete(ref_llm, prompts, mt)
    c = client(spec)
    out, lat = {}, {}

    def one(i):
        t0 = time.perf_counter()
        try:
            out[i] = stream_completion(c, prompts[i], mt)
        except Exception as e:  # noqa: BLE001 - recorded and asserted on below
            out[i] = e
        lat[i] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    wall = time.perf_counter() - t0
    errors = [out.get(i) for i in range(n) if not isinstance(out.get(i), tuple)]
    assert not errors, errors[:3]
    for i in range(n):
        text, ids, fin, usage = out[i]
        assert ids == refs[i].token_ids and text == refs[i].text, i
    wait_idle(spec)
    ls = sorted(lat.values())
    toks = sum(len(r.token_ids) for r in refs)
    print(f"\n32 streams: p50 {ls[n // 2]:.2f}s p99 {ls[-1]:.2f}s, {toks / wall:.0f} output tokens/s")


# ---------------------------------------------------------------- the command line
def test_resolve_config(model_dir, head_dir, monkeypatch, tmp_path):
    from peagle import llm
    from peagle.errors import PeagleError
    from peagle.server.start import ENV_SPEC, resolve_config
    env = {ENV_SPEC: json.dumps(spec_cfg(head_dir))}
    assert resolve_config(model_dir, None, env)[2].num_speculative_tokens == K          # from the environment
    flag = json.dumps({**spec_cfg(head_dir), "num_speculative_tokens": 2, "parallel_drafting": False})
    s = resolve_config(model_dir, flag, env)[2]                                          # the flag wins
    assert s.num_speculative_tokens == 2 and not s.parallel_drafting
    assert resolve_config(model_dir, "none", env)[2] is None
    with pytest.raises(PeagleError):
        resolve_config(model_dir, '{"method": "medusa"}', {})
    with pytest.raises(PeagleError):
        resolve_config(str(tmp_path / "missing"), None, {})
    # no model: the default target with its P-EAGLE head (K chosen per step, parallel drafting)
    monkeypatch.setattr(llm, "DEFAULT_MODEL", model_dir)
    monkeypatch.setattr(llm, "DEFAULT_PEAGLE_HEAD", head_dir)
    m, name, s = resolve_config(None, None, {})
    assert m == model_dir and s.num_speculative_tokens == "auto" and s.parallel_drafting and s.model == head_dir
    monkeypatch.setattr(llm, "DEFAULT_MODEL", str(tmp_path / "missing"))
    with pytest.raises(PeagleError, match="default target"):
        resolve_config(None, None, {})


def test_resolve_config_names_where_a_bad_config_came_from(model_dir):
    """A bad $PEAGLE_SPECULATIVE_CONFIG read like a bad flag the user never typed: its error names the variable
    (a flag's does not); a model's config.json given as the model is "a file", not "does not exist"."""
    from peagle.errors import PeagleError
    from peagle.server.start import ENV_SPEC, resolve_config
    with pytest.raises(PeagleError, match=r"^\$PEAGLE_SPECULATIVE_CONFIG: .*not valid JSON"):
        resolve_config(model_dir, None, {ENV_SPEC: '{"method":'})
    with pytest.raises(PeagleError, match="not valid JSON") as e:
        resolve_config(model_dir, '{"method":', {ENV_SPEC: json.dumps({"method": "eagle3"})})
    assert ENV_SPEC not in str(e.value)
    with pytest.raises(PeagleError, match="is a file, not a model directory"):
        resolve_config(os.path.join(model_dir, "config.json"), None, {})


def test_cli_serve_subprocess(model_dir, head_dir, ref_llm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PEAGLE_SPECULATIVE_CONFIG": json.dumps(spec_cfg(head_dir)), "OMP_NUM_THREADS": "1",
           "PEAGLE_API_KEY": "sk-env-1, sk-env-2"}
    env.pop("VLLM_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "peagle.cli", "serve", model_dir, "--port", str(port),
                          "--max-num-seqs", "4", "--max-tokens-limit", "16", "--log-level", "warning"], env=env,
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        class S:
            url = f"http://127.0.0.1:{port}"
            state = types.SimpleNamespace(api_keys=("sk-env-2",))     # the helpers send this key
        t0 = time.monotonic()
        while True:
            try:
                if get_json(S, "/health")["status"] == "ok":
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert p.poll() is None, p.stdout.read().decode()
            assert time.monotonic() - t0 < 90, "server did not come up"
            time.sleep(0.2)
        d = get_json(S, "/debug/engine")
        assert d["speculative"]["method"] == "peagle" and d["max_num_seqs"] == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=S.url + "/v1", api_key="none", max_retries=0).models.list()
        c = client(S)
        ref = ref_complete(ref_llm, [PROMPTS[4]], 16)[0]
        r = c.completions.create(model=model_dir, prompt=PROMPTS[4], max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text
        with pytest.raises(openai.BadRequestError, match="at most 16"):
            c.completions.create(model=model_dir, prompt=PROMPTS[4], max_tokens=17)
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def test_a_prompt_being_tokenized_does_not_stall_other_clients(plain):
    """Prompts were rendered and tokenized on the event loop: one huge chat request (500,000 empty messages took
    15-20 s) held /health and every stream until it was done. A tokenizer held at a gate here: /health answers
    while it waits, and the request completes once it goes on."""
    gate, entered = threading.Event(), threading.Event()
    real = plain.state.tokenizer

    class Held:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *a, **k):
            entered.set()
            gate.wait(30)
            return real(*a, **k)

    plain.state.tokenizer = Held()
    got = {}
    t = threading.Thread(target=lambda: got.update(r=post(plain, "/v1/completions",
                                                           json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode())))
    try:
        t.start()
        assert entered.wait(10)
        assert client_http.get_json(plain.url + "/health", 5)["status"] == "ok"    # before the gate's 30 s
    finally:
        gate.set()
        t.join(30)
        plain.state.tokenizer = real
    assert got["r"][0] == 200, got


@pytest.mark.parametrize("server", ["plain", "spec"], indirect=True)
def test_a_stop_token_is_left_out_of_the_text_and_named_in_stop_reason(server, ref_llm):
    """vLLM leaves the token that stopped a request out of its text and names it in each choice's stop_reason
    (a stop string: the string); the server kept a stop_token_ids token's text and sent no stop_reason."""
    tok = ref_llm.get_tokenizer()
    free = ref_complete(ref_llm, ["Once upon a time, in a land"], 24, ignore_eos=True)[0]
    t = next(i for i in free.token_ids[2:] if i not in tok.all_special_ids and tok.decode([i]).strip())
    cut = free.token_ids.index(t) + 1
    want = tok.decode(free.token_ids[:cut - 1], skip_special_tokens=True)
    body = {"prompt": "Once upon a time, in a land", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [t]}
    code, js = post(server, "/v1/completions", json.dumps(body).encode())
    assert code == 200 and js["choices"][0]["text"] == want and js["choices"][0]["stop_reason"] == t, js
    assert js["usage"]["completion_tokens"] == cut
    text, ids, fin, _ = stream_completion(client(server), body["prompt"], 24,
                                          extra_body={"ignore_eos": True, "stop_token_ids": [t]})
    assert (text, ids, fin) == (want, free.token_ids[:cut], "stop")
    s = tok.decode(free.token_ids, skip_special_tokens=True)[3:7]
    code, js = post(server, "/v1/completions", json.dumps({**body, "stop_token_ids": [], "stop": [s]}).encode())
    assert code == 200 and js["choices"][0]["stop_reason"] == s, js
