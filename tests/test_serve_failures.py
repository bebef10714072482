"""`peagle serve` when things go wrong: bad input gets 4xx OpenAI-style errors; a disconnect frees its row at
once and an abort mid-batch leaves its neighbours exact; overload gets 429 and an internal error fails only its
request, and the server stays healthy and exact after each."""
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from serving import (  # noqa: F401 (fixtures)
    PROMPTS,
    client,
    get_json,
    get_text,
    head_dir,
    model_dir,
    plain,
    post,
    ref_complete,
    ref_llm,
    spec,
    start,
    stream_completion,
    wait_idle,
)

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
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
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
    failed0 = state.metrics.failed._value.get()

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
        assert state.metrics.failed._value.get() - failed0 == 1         # peagle:requests_failed counts the 500
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


def test_shutdown_answers_every_request_in_flight(model_dir, ref_llm):
    """Stopping the server (a signal's path) with requests in flight: a request that finishes within the grace
    gets its whole answer, the waiting ones a 503 at once, one still running at the deadline a 503 (JSON; a
    stream: an error event) -- uvicorn used to cancel them all after its graceful timeout (a bare 500 in
    text/plain, a stream cut without an event) while the engine went on generating for them."""
    srv = start(model_dir, max_num_seqs=2, max_waiting=4)
    eng = srv.state.engine
    step = eng.step
    eng.step = lambda: (time.sleep(0.01), step())[1]           # ~100 steps/s: max_tokens 900 outlasts the grace
    body = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True}
    res = {}

    def call(name, extra):
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({**body, **extra}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        res[name] = (r.status, r.getheader("content-type"), r.read().decode())
    jobs = {"short": {"max_tokens": 40}, "long": {"max_tokens": 900}, "wait": {"max_tokens": 900},
            "wait_stream": {"max_tokens": 900, "stream": True}}
    ts = []
    for name, extra in jobs.items():
        ts.append(threading.Thread(target=call, args=(name, extra)))
        ts[-1].start()
        time.sleep(0.3)                                          # in this order: short and long run, the rest wait
    srv.stop()
    for t in ts:
        t.join(30)
    status, ctype, text = res["short"]
    assert status == 200 and json.loads(text)["choices"][0]["text"] == ref_complete(ref_llm, [PROMPTS[0]], 40,
                                                                                       ignore_eos=True)[0].text
    for name in ("long", "wait"):
        status, ctype, text = res[name]
        assert status == 503 and ctype == "application/json" and "shutting down" in json.loads(text)["error"]["message"]
    status, ctype, text = res["wait_stream"]
    assert "shutting down" in text and ctype.startswith("text/event-stream"), res["wait_stream"]


def test_a_client_gone_before_its_body_is_not_a_server_error(plain):
    """Headers promising 1000 bytes, 10 sent, then the socket closed: logged as an unhandled error and counted as
    a 500 before; now a 499 (client closed), nothing failed."""
    def count(status):
        key = f'peagle:http_requests_total{{route="/v1/completions",status="{status}"}}'
        return sum(float(x.split()[-1]) for x in get_text(plain, "/metrics").splitlines() if x.startswith(key))
    before = count(499), count(500)
    s = socket.create_connection((plain.host, plain.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
    s.close()
    deadline = time.monotonic() + 10
    while count(499) == before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (count(499), count(500)) == (before[0] + 1, before[1])


def test_prompt_tokens_count_prompts_that_were_prefilled(model_dir):
    """vllm:prompt_tokens_total counted every submitted prompt, prefilled or not (aborted while waiting)."""
    srv = start(model_dir, max_num_seqs=1, max_waiting=4)
    try:
        c = client(srv)
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0)
        n = r.usage.prompt_tokens
        line = [x for x in get_text(srv, "/metrics").splitlines() if x.startswith("vllm:prompt_tokens_total")]
        assert float(line[0].split()[-1]) == n
        # a request that waits behind a running one and leaves before its prefill counts nothing
        step = srv.state.engine.step
        srv.state.engine.step = lambda: (time.sleep(0.01), step())[1]
        t = threading.Thread(target=lambda: c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=300,
                                                                   temperature=0, extra_body={"ignore_eos": True}))
        t.start()
        time.sleep(0.3)
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 4}),
                     {"Content-Type": "application/json"})
        time.sleep(0.3)
        conn.sock.close()                                        # gone while waiting
        t.join(60)
        wait_idle(srv)
        line = [x for x in get_text(srv, "/metrics").splitlines() if x.startswith("vllm:prompt_tokens_total")]
        p2 = len(srv.state.tokenizer(PROMPTS[2])["input_ids"])              # as the server encodes it
        assert float(line[0].split()[-1]) == n + p2
    finally:
        srv.stop()


def test_ctrl_c_stops_peagle_serve_cleanly(model_dir):
    """Ctrl-C (SIGINT) on `peagle serve`: a clean shutdown, exit status 0 (uvicorn's Server.run re-raises the
    signal it handled after shutting down; uncaught, it was exit 130 and 'peagle: interrupted'). The server
    client.launch started has the row count it was asked for (`peagle bench --mode online` sizes it so)."""
    import signal

    from peagle import client as client_http
    p, url = client_http.launch(model_dir, None, 3)
    try:
        assert client_http.get_json(url + "/health", 5)["status"] == "ok"
        assert client_http.get_json(url + "/debug/engine", 5)["max_num_seqs"] == 3
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
    finally:
        client_http.stop(p)


def test_launch_takes_a_model_path_relative_to_the_callers_directory(model_dir, tmp_path, monkeypatch):
    """client.launch (`peagle bench --mode online`) ran the server in the checkout, so a model path relative to
    the caller's directory named nothing there ('model directory ... does not exist')."""
    from peagle import client as client_http
    (tmp_path / "mine").mkdir()
    os.symlink(os.path.abspath(model_dir), tmp_path / "mine" / "model")
    monkeypatch.chdir(tmp_path)
    p, url = client_http.launch(os.path.join("mine", "model"), None, 2)
    try:
        assert client_http.get_json(url + "/health", 5)["status"] == "ok"
    finally:
        client_http.stop(p)


def test_a_full_server_answers_429_before_tokenizing(plain):
    """With every slot taken, a request got its prompt rendered and tokenized before the 429 (a review of what a
    hostile client can make a busy server do): now the 429 comes first."""
    loop = plain.state.loop
    calls, real = [], plain.state.tokenizer

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *a, **k):
            calls.append(1)
            return real(*a, **k)

    held = 0
    plain.state.tokenizer = Counting()
    try:
        while loop.try_reserve():
            held += 1
        code, js = post(plain, "/v1/completions", json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode())
        assert code == 429 and js["error"]["code"] == "rate_limit_exceeded" and not calls
    finally:
        for _ in range(held):
            loop.unreserve()
        plain.state.tokenizer = real
    code, _ = post(plain, "/v1/completions", json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode())
    assert code == 200 and calls == []                    # the real tokenizer again
