"""API keys (peagle/server/auth.py) on a real server, through the official openai client: no key, a wrong key
and each right key; /health and /metrics stay open, everything else needs the key; the comparison is
constant-time; where keys come from; the warning for a server reachable from elsewhere without a key."""
import hmac
import json
import urllib.error
import urllib.request

import openai
import pytest
from serving import client, get_json, model_dir, post, ref_complete, ref_llm, start  # noqa: F401 (fixtures)

from peagle import cli
from peagle.errors import PeagleError
from peagle.server import auth
from peagle.server.auth import ApiKeyAuth, exposed_without_key, resolve_api_keys

KEYS = ("sk-first-key", "sk-second")
BODY = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def keyed(model_dir):
    srv = start(model_dir, max_num_seqs=4, api_keys=KEYS)
    yield srv
    srv.stop()


def _as(srv, key):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_keys_none_wrong_right(keyed, ref_llm):
    ref = ref_complete(ref_llm, ["Hello there"], 8)[0]
    # no key, another scheme, wrong keys (a prefix of a right one, one longer, another's): 401, OpenAI-style
    for headers in ({}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer"}):
        code, js = post(keyed, "/v1/completions", BODY, headers=headers, auth=False)
        assert code == 401 and set(js["error"]) == {"message", "type", "param", "code"}, (headers, js)
    for wrong in ("sk-wrong", KEYS[0][:-1], KEYS[0] + "x", KEYS[0].upper(), "none"):
        code, js = post(keyed, "/v1/completions", BODY, headers={"Authorization": f"Bearer {wrong}"}, auth=False)
        assert code == 401 and js["error"]["code"] == "invalid_api_key", (wrong, js)
        assert wrong not in js["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            _as(keyed, wrong).completions.create(model="tiny", prompt="Hello there", max_tokens=8)
        with pytest.raises(openai.AuthenticationError):
            _as(keyed, wrong).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            _as(keyed, wrong).models.list()
    # every key works, for both endpoints, streaming or not, and the output is exact
    for key in KEYS:
        c = _as(keyed, key)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
        assert r.choices[0].text == ref.text
        s = c.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in s) == ref.text
        assert c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4).choices[0].message.role == "assistant"
    # open without a key: /health and /metrics (as in vLLM); closed: /v1/*, /debug/*, unknown paths
    for path, want in (("/health", 200), ("/metrics", 200), ("/v1/models", 401), ("/debug/engine", 401),
                       ("/v1/nope", 401), ("/nope", 401)):
        code, _ = _get_status(keyed, path)
        assert code == want, path
    assert get_json(keyed, "/debug/engine")["rows_in_use"] == 0          # with the key
    assert 'status="401"' in _get_status(keyed, "/metrics")[1]


def _get_status(srv, path):
    """GET without a key -> (status, text)."""
    try:
        with urllib.request.urlopen(srv.url + path, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        assert e.code != 401 or e.headers.get("WWW-Authenticate") == "Bearer"
        return e.code, e.read().decode()


def test_server_without_keys_stays_open(model_dir, ref_llm):
    srv = start(model_dir, max_num_seqs=2)
    try:
        r = client(srv).completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
        assert r.choices[0].text == ref_complete(ref_llm, ["Hello there"], 8)[0].text
        assert _get_status(srv, "/debug/engine")[0] == 200
    finally:
        srv.stop()


def test_key_compare_is_constant_time(monkeypatch):
    """Every key is compared whatever the outcome (no early exit on a match), always through
    hmac.compare_digest and on equal-length digests (no length or prefix leaks)."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    keys = ["sk-" + "a" * 40, "short", "sk-third"]
    guard = ApiKeyAuth(None, keys)
    for token, want in ((b"sk-" + b"a" * 40, True), (b"short", True), (b"sk-third", True), (b"sk-" + b"a" * 39, False),
                        (b"", False), (b"x" * 5000, False), (b"SHORT", False)):
        calls.clear()
        assert guard.allowed(token) is want, token
        assert calls == [(32, 32)] * len(keys), token


def test_resolve_api_keys():
    env = {"PEAGLE_API_KEY": "p1, p2", "VLLM_API_KEY": "v"}
    assert resolve_api_keys(["a,b", " c "], env) == ("a", "b", "c")          # the flag wins, comma-separated
    assert resolve_api_keys(None, env) == ("p1", "p2")
    assert resolve_api_keys([], {"VLLM_API_KEY": "v"}) == ("v",)
    assert resolve_api_keys(None, {}) == ()


def test_an_empty_api_key_flag_is_refused_not_served_unguarded():
    """`--api-key "$KEY"` with KEY unset gave --api-key "": no key, so the server ran without auth (or with the
    environment's keys) and said nothing."""
    for flags in ([""], [" , "], ["", " "]):
        with pytest.raises(PeagleError, match="--api-key is empty"):
            resolve_api_keys(flags, {"PEAGLE_API_KEY": "p"})
    assert resolve_api_keys(["", "k"], {}) == ("k",)          # one flag empty, another with a key: the key


def test_exposed_without_key_warning(model_dir, monkeypatch, capsys):
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.5"):
        assert not exposed_without_key(host, ())
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        assert exposed_without_key(host, ()) and not exposed_without_key(host, ("k",))
    # the command warns before it loads anything (here it then stops at an invalid --max-num-seqs: no port bound)
    for var in auth.ENV_KEYS:
        monkeypatch.delenv(var, raising=False)
    argv = ["serve", model_dir, "--host", "0.0.0.0", "--max-num-seqs", "0"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "WARNING: binding 0.0.0.0 without an API key" in err and "--max-num-seqs" in err
    assert cli.main(argv + ["--api-key", "k"]) == 1
    assert "WARNING" not in capsys.readouterr().err
    monkeypatch.setenv("VLLM_API_KEY", "k")
    assert cli.main(argv) == 1
    assert "WARNING" not in capsys.readouterr().err
