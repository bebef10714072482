"""`peagle serve`: a real uvicorn server on a loopback port, driven by the official openai client.

Greedy outputs must be identical to plain `LLM.generate` / `LLM.chat` (no speculation), with and without a
speculative config; bad input gets 4xx OpenAI-style errors; disconnects free rows at once; overload gets 429
and the server stays healthy and exact."""
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import openai
import pytest
from serving import (  # noqa: F401 (fixtures)
    K,
    client,
    get_json,
    get_text,
    greedy,
    head_dir,
    model_dir,
    post,
    ref_complete,
    ref_llm,
    spec_cfg,
    start,
    stream_completion,
    wait_idle,
)

from peagle import SamplingParams
from peagle.server.detok import IncrementalDetokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Hello there", "The quick brown fox", "Speculative decoding drafts", "Once upon a time, in a land",
           "café naïve 東京 😀", "def main(): return", "Numbers: 1 2 3", "Servers stream tokens"]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox."}]]


@pytest.fixture(scope="module")
def plain(model_dir):
    srv = start(model_dir, max_num_seqs=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec(model_dir, head_dir):
    srv = start(model_dir, spec_cfg(head_dir), max_num_seqs=64)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["plain", "peagle"])
def server(request):
    return request.getfixturevalue("plain" if request.param == "plain" else "spec")


# ---------------------------------------------------------------- unit: incremental detokenization
def test_detokenizer_stream_equals_final_text(model_dir):
    """Random token streams (many invalid UTF-8 byte tokens) in random chunk sizes, with stop strings: the
    streamed pieces concatenate to exactly decode(ids)[:stop_at], and nothing past a stop start is sent."""
    from peagle.llm import load_tokenizer
    tok = load_tokenizer(model_dir)
    rng = random.Random(0)
    for trial in range(150):
        ids = [rng.randrange(5, 512) for _ in range(rng.randrange(1, 60))]
        full = tok.decode(ids, skip_special_tokens=True)
        stops = []
        if trial % 2 and len(full) > 4:
            a = rng.randrange(len(full) - 2)
            stops = [full[a:a + rng.randrange(1, 4)], "zzq"]
        # what the engine does: after each token, look for a stop string in the decoded text
        out, stop_at = [], None
        for t in ids:
            out.append(t)
            text = tok.decode(out, skip_special_tokens=True)
            hits = [text.find(s) for s in stops if s and s in text]
            if hits:
                stop_at = min(hits)
                break
        want = tok.decode(out, skip_special_tokens=True)
        want = want if stop_at is None else want[:stop_at]
        d = IncrementalDetokenizer(tok, stops)
        sent, i = "", 0
        while True:
            n = rng.randrange(1, 5)
            if i + n >= len(out):
                sent += d.finish(stop_at, out[i:])
                break
            sent += d.add(out[i:i + n])
            assert want.startswith(sent), (trial, sent, want)
            i += n
        assert sent == want, (trial, stops)


# ---------------------------------------------------------------- identity with plain decoding
def test_models_health_metrics(plain):
    assert get_json(plain, "/health") == {"status": "ok"}
    ms = client(plain).models.list().data
    assert [m.id for m in ms] == ["tiny"] and ms[0].model_extra["max_model_len"] == 1024
    text = get_text(plain, "/metrics")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:generation_tokens_total", "peagle:cache_rows_in_use"):
        assert name in text, name


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


# ---------------------------------------------------------------- bad input
BAD = [  # (path, body, status, param)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", b'\xff\xfe', 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": 7, "prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1024}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "word " * 3000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 1100}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 123}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages"),
]


def test_bad_requests_get_openai_errors(plain, ref_llm):
    for path, body, status, param in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        code, js = post(plain, path, raw)
        assert code == status, (body if isinstance(body, bytes) else str(body)[:80], code, js)
        err = js["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param, (str(body)[:80], err)
    code, js = post(plain, "/v1/completions", json.dumps({"prompt": "x" * (9 << 20)}).encode())
    assert code == 413 and js["error"]["code"] == "request_too_large"
    code, js = post(plain, "/v1/completions", b"{}", headers={"Content-Length": str(1 << 30)})
    assert code == 413
    try:
        urllib.request.urlopen(plain.url + "/nope", timeout=10)
        raise AssertionError("no 404")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and "error" in json.loads(e.read())
    c = client(plain)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # the server is fine afterwards: healthy, nothing leaked, and outputs still exact
    assert get_json(plain, "/health") == {"status": "ok"}
    wait_idle(plain)
    ref = ref_complete(ref_llm, [PROMPTS[0]], 12)[0]
    assert c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text \
        == ref.text


# ---------------------------------------------------------------- disconnects
def _raw_request(srv, body):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_disconnect_mid_stream_aborts_at_once(plain, ref_llm):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = get_json(plain, "/debug/engine")["steps"]
    for stream in (True, False):
        conn = _raw_request(plain, {**body, "stream": stream})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            line = resp.readline()             # the first SSE event: the request is running
            assert line.startswith(b"data: ")
        else:
            t0 = time.monotonic()
            while get_json(plain, "/debug/engine")["rows_in_use"] == 0 and time.monotonic() - t0 < 10:
                time.sleep(0.02)
        assert get_json(plain, "/debug/engine")["rows_in_use"] == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        t = wait_idle(plain, timeout=10)
        assert t < 5, f"row freed only after {t:.1f}s"
        print(f"\n{'stream' if stream else 'non-stream'} disconnect: row freed after {t * 1000:.0f} ms")
    # 900 tokens would take far more steps than were run: the requests were aborted, not finished
    assert get_json(plain, "/debug/engine")["steps"] - before < 900
    assert 'peagle:requests_aborted_total{model_name="tiny"}' in get_text(plain, "/metrics")
    ref = ref_complete(ref_llm, [PROMPTS[2]], 12)[0]
    r = client(plain).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text


def test_abort_mid_batch_keeps_neighbours_exact(spec, ref_llm):
    """The official client closes a stream mid-way while two neighbours keep decoding with speculation: the
    aborted row is freed at once (rows are compacted, target and drafter caches move) and the neighbours'
    outputs stay identical to plain decoding."""
    mt = 60
    refs = ref_complete(ref_llm, PROMPTS[:3], mt, ignore_eos=True)
    c = client(spec)
    out = {}

    def full(i):
        try:
            out[i] = stream_completion(c, PROMPTS[i], mt, extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - recorded and asserted on below
            out[i] = e
    ts = [threading.Thread(target=full, args=(i,)) for i in (0, 2)]
    for t in ts:
        t.start()
    s = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=900, temperature=0, stream=True,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    it = iter(s)
    for _ in range(3):
        next(it)
    s.close()
    t0 = time.monotonic()
    while get_json(spec, "/debug/engine")["in_flight"] > 2 and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert get_json(spec, "/debug/engine")["in_flight"] <= 2
    for t in ts:
        t.join(120)
    for i in (0, 2):
        assert isinstance(out[i], tuple), out[i]
        assert out[i][1] == refs[i].token_ids
    wait_idle(spec)


# ---------------------------------------------------------------- overload and failures
def test_overload_gets_429_and_server_stays_exact(model_dir, ref_llm):
    srv = start(model_dir, max_num_seqs=2, max_waiting=2)
    try:
        n, results = 20, {}
        refs = ref_complete(ref_llm, [PROMPTS[i % len(PROMPTS)] for i in range(n)], 16)
        barrier = threading.Barrier(n)
        c = client(srv)

        def one(i):
            barrier.wait(10)
            try:
                if i % 2:
                    text, ids, _, _ = stream_completion(c, PROMPTS[i % len(PROMPTS)], 16)
                else:
                    r = c.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=16,
                                             temperature=0)
                    text = r.choices[0].text
                results[i] = ("ok", text)
            except openai.RateLimitError as e:
                results[i] = ("429", e.body)
            except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                results[i] = ("error", repr(e))

        ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        kinds = [results[i][0] for i in range(n)]
        assert "error" not in kinds, results
        assert kinds.count("429") > 0 and kinds.count("ok") >= 4, kinds
        for i in range(n):
            if results[i][0] == "ok":
                assert results[i][1] == refs[i].text
            else:
                assert results[i][1]["code"] == "rate_limit_exceeded"
        assert get_json(srv, "/health") == {"status": "ok"}
        wait_idle(srv)
        assert "peagle:requests_rejected_total" in get_text(srv, "/metrics")
        r = c.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=16, temperature=0)
        assert r.choices[0].text == refs[5].text
    finally:
        srv.stop()


def test_internal_error_fails_only_that_request(plain, ref_llm):
    state = plain.state
    target = state.engine.target
    orig = target.forward
    poison = ref_llm.tokenizer("Numbers: 1 2 3", add_special_tokens=False)["input_ids"]
    mode = {"decode_fail": False, "gate": True}
    errors0 = state.loop.step_errors

    def faulty(toks, *a, **kw):
        if mode["gate"] and "logits_at" in kw:
            # hold the first prefill until the other requests are queued: they are then prefilled together
            mode["gate"] = False
            t0 = time.monotonic()
            while len(state.loop._cmds) < 3 and time.monotonic() - t0 < 20:
                time.sleep(0.01)
        if "logits_at" in kw and any(row[:len(poison)] == poison for row in toks.tolist()):
            raise RuntimeError("poisoned prefill")
        if mode["decode_fail"] and "logits_at" not in kw:
            mode["decode_fail"] = False
            raise RuntimeError("decode blew up")
        return orig(toks, *a, **kw)

    target.forward = faulty
    try:
        c = client(plain)
        ok = ref_complete(ref_llm, PROMPTS[:3], 20)
        res = {}
        def one(i, p):
            try:
                if i == 3:
                    res[i] = stream_completion(c, p, 20)[0]
                else:
                    res[i] = c.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0).choices[0].text
            except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                res[i] = e
        ts = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(PROMPTS[:3] + ["Numbers: 1 2 3"])]
        ts[0].start()                    # the gate request; the other three arrive while it is held
        while mode["gate"]:
            time.sleep(0.01)
        for t in ts[1:]:
            t.start()
        for t in ts:
            t.join(60)
        assert [res[i] for i in range(3)] == [o.text for o in ok]
        assert isinstance(res[3], openai.APIError) and "poisoned prefill" in str(res[3])
        # the poisoned batch failed once, then the poisoned request alone: its neighbours were retried
        assert state.loop.step_errors - errors0 == 2
        # a failure while decoding fails the running batch (state unknown), not the server
        mode["decode_fail"] = True
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
        wait_idle(plain)
        assert c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20,
                                    temperature=0).choices[0].text == ok[0].text
        assert get_json(plain, "/health") == {"status": "ok"}
    finally:
        target.forward = orig


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
