"""Property-based fuzz of `peagle serve` (hypothesis) against a real server: a P-EAGLE head (parallel drafting),
an API key and small limits.

Requests for both endpoints: well-formed ones (to get answers that run the engine) and hostile ones: every field
of the right or any JSON type, in and out of range, any Unicode (lone surrogates as JSON escapes, as raw bytes,
bytes that are not UTF-8), nested junk, bodies over the limit, broken or truncated JSON, deep nesting, huge
integers, a missing or wrong key; streaming or not, sometimes hanging up mid-way. Properties: every answer is a
complete HTTP response below 500 (a 4xx carries an OpenAI-style error; a 200 a full JSON body, or an SSE stream
that ends in [DONE] with no error event), no connection is dropped by the server; afterwards the server is
healthy, no row is in use, no engine step failed, and greedy outputs are identical to plain offline decoding.
Derandomized (a fixed seed, no example database); PEAGLE_FUZZ_EXAMPLES sets how many (default 400)."""
import collections
import http.client
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import (  # noqa: F401 (fixtures)
    client,
    get_json,
    greedy,
    head_dir,
    model_dir,
    ref_complete,
    ref_llm,
    spec_cfg,
    start,
    wait_idle,
)

from peagle.server.limits import Limits

EXAMPLES = int(os.environ.get("PEAGLE_FUZZ_EXAMPLES", "400"))
KEY = "sk-fuzz-key"
LIMITS = Limits(max_body_bytes=16384, max_prompt_tokens=64, max_tokens_limit=16, default_max_tokens=6, max_stop=2,
                max_stop_chars=16)
PROMPTS = ["Hello there", "The quick brown fox", "café naïve 東京 😀", "def main(): return"]
PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}

# ------------------------------------------------------------------ values
surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)     # st.text() would drop these
valid_texts = st.one_of(st.sampled_from(PROMPTS), st.text(max_size=24),
                        st.builds(lambda s, n: s * n, st.sampled_from(["word ", "x", "東京", "😀"]),
                                  st.integers(0, 2000)))
texts = st.one_of(valid_texts, st.lists(st.one_of(st.characters(), surrogate), max_size=12).map("".join))
ints = st.one_of(st.integers(-3, 40), st.integers(-2 ** 70, 2 ** 70),     # and the edges of machine integers:
                 st.sampled_from([2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), texts)
junk = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(texts, c, max_size=4)),
                    max_leaves=10)
ids = st.lists(st.integers(0, 511), min_size=1, max_size=70)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": texts}),
                 max_size=3)
roles = st.sampled_from(["system", "user", "user", "assistant", "developer", "tool", "wizard"])

# field -> valid values (a hostile request also draws any JSON)
COMMON = {
    "model": st.sampled_from(["tiny", "other"]),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 20)),
    "temperature": st.one_of(st.sampled_from([0, 0.0]), st.floats(0, 3), st.floats(min_value=0)),
    "top_p": st.floats(0, 1),
    "top_k": st.one_of(st.integers(-2, 600), ints),
    "seed": ints,
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": st.lists(st.integers(-1, 520), max_size=3),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "n": st.sampled_from([1, 1, 2]),
    "presence_penalty": st.sampled_from([0, 0.5]),
    "logit_bias": st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100), max_size=2),
    "user": texts,
}
FIELDS = {
    False: {"prompt": st.one_of(texts, ids, st.lists(texts, max_size=2), st.lists(ids, max_size=2)),
            **COMMON, "echo": st.booleans(), "best_of": st.integers(0, 2), "suffix": texts},
    True: {"messages": st.lists(st.fixed_dictionaries({"role": roles, "content": st.one_of(texts, st.none(), parts)},
                                                      optional={"name": texts}), max_size=4),
           **COMMON, "max_completion_tokens": st.integers(-1, 20), "logprobs": st.booleans(),
           "tools": st.lists(junk, max_size=2), "tool_choice": junk,
           "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})},
}
SIMPLE = ("max_tokens", "temperature", "top_p", "top_k", "stream", "stop", "seed", "return_token_ids", "ignore_eos",
          "stream_options")


def _body(chat: bool, hostile: bool):
    fields = FIELDS[chat]
    first = "messages" if chat else "prompt"
    if hostile:                      # any field, each valid or any JSON value
        pick = {k: st.one_of(v, v, v, junk) for k, v in fields.items()}
        return st.fixed_dictionaries({}, optional={**pick, "unknown": junk})
    easy = {first: st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}), min_size=1,
                            max_size=2) if chat else st.one_of(texts, ids)}
    stop = st.one_of(valid_texts, st.lists(valid_texts, max_size=3))
    return st.fixed_dictionaries(easy, optional={**{k: fields[k] for k in SIMPLE}, "stop": stop}).map(
        lambda b: {**b, "stream": True} if "stream_options" in b else b)      # valid only with stream


@st.composite
def cases(draw):
    chat = draw(st.booleans())
    body = draw(_body(chat, hostile=draw(st.booleans())))
    enc = draw(st.sampled_from(["json"] * 6 + ["raw", "byte", "truncate", "oversize", "deep", "bigint", "scalar"]))
    raw = json.dumps(body, ensure_ascii=enc != "raw").encode("utf-8", "surrogatepass")
    if enc == "byte":                # one byte replaced by any byte (often not UTF-8, or broken JSON)
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    elif enc == "truncate":
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif enc == "oversize":          # over the limit, but not so far that the server cuts the connection
        raw = b"{" + b" " * (LIMITS.max_body_bytes + draw(st.integers(0, LIMITS.max_body_bytes))) + raw[1:]
    elif enc == "deep":
        n = draw(st.integers(1, 5000))
        raw = raw[:-1] + (b", " if len(raw) > 2 else b"") + b'"deep": ' + b"[" * n + b"]" * n + b"}"
    elif enc == "bigint":
        raw = raw[:-1] + (b", " if len(raw) > 2 else b"") + b'"seed": ' + b"9" * draw(st.integers(1, 6000)) + b"}"
    elif enc == "scalar":
        raw = json.dumps(draw(junk)).encode("utf-8", "surrogatepass")
    auth = draw(st.sampled_from(["key"] * 8 + ["none", "wrong"]))
    hangup = draw(st.sampled_from([False] * 9 + [True]))
    stream = isinstance(body, dict) and body.get("stream") is True
    return PATHS[chat], raw, auth, hangup, f"{'chat' if chat else 'completions'}/{'stream' if stream else 'json'}"


# ------------------------------------------------------------------ one request
def send(srv, path, raw, auth, hangup):
    """-> (status or "hangup", problem or None)."""
    headers = {"Content-Type": "application/json"}
    if auth != "none":
        headers["Authorization"] = f"Bearer {KEY if auth == 'key' else 'sk-wrong'}"
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", path, body=raw, headers=headers)
        if hangup and b'"stream": true' not in raw:
            return "hangup", None    # gone before the answer
        resp = conn.getresponse()
        if resp.getheader("content-type", "").startswith("text/event-stream"):
            if hangup:
                resp.readline()
                return "hangup", None
            return resp.status, _check_sse(resp.read().decode())
        body = resp.read()
        try:
            js = json.loads(body)
        except ValueError:
            return resp.status, f"not JSON: {body[:200]!r}"
        if resp.status == 200:
            return 200, None if js.get("choices") and "usage" in js else f"incomplete answer: {js}"
        err = js.get("error") if isinstance(js, dict) else None
        ok = isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and err["message"]
        return resp.status, None if ok else f"not an OpenAI error: {js}"
    except (OSError, http.client.HTTPException) as e:        # the server dropped the connection
        return "dropped", repr(e)
    finally:
        conn.close()


def _check_sse(text: str):
    events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream did not end in [DONE]: {text[-300:]!r}"
    for e in events[:-1]:
        js = json.loads(e)
        if "error" in js:
            return f"error event: {js}"
    return None


# ------------------------------------------------------------------ the test
@pytest.fixture(scope="module")
def fuzz_srv(model_dir, head_dir):
    srv = start(model_dir, spec_cfg(head_dir), max_num_seqs=8, limits=LIMITS, api_keys=(KEY,))
    yield srv
    srv.stop()


def test_fuzz_both_endpoints(fuzz_srv, ref_llm, summary_note):
    statuses, kinds = collections.Counter(), collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def one(case):
        path, raw, auth, hangup, kind = case
        status, problem = send(fuzz_srv, path, raw, auth, hangup)
        statuses[status] += 1
        kinds[kind] += 1
        assert problem is None, (status, problem, raw[:300])
        assert status == "hangup" or status < 500, (status, raw[:300])

    one()
    n = sum(statuses.values())
    line = (f"fuzz: {n} requests ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); statuses "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(statuses.items(), key=str))}; 0 5xx, 0 dropped")
    print("\n" + line)
    summary_note(line)
    # the fuzz reached every kind of answer (it is not all 400s)
    for s in (200, 400, 401, 413, "hangup"):
        assert statuses[s] > 0, (s, statuses)
    # afterwards: healthy, nothing left in use, no engine step failed, greedy output exact
    assert get_json(fuzz_srv, "/health") == {"status": "ok"}
    wait_idle(fuzz_srv)
    assert get_json(fuzz_srv, "/debug/engine")["step_errors"] == 0
    c = client(fuzz_srv)
    for p, ref in zip(PROMPTS, ref_complete(ref_llm, PROMPTS, 16)):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text
        s = c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in s) == ref.text
    conv = [{"role": "user", "content": PROMPTS[1]}]
    ref = ref_llm.chat(conv, greedy(16))[0].outputs[0].text
    assert c.chat.completions.create(model="tiny", messages=conv, max_tokens=16,
                                     temperature=0).choices[0].message.content == ref
    wait_idle(fuzz_srv)
