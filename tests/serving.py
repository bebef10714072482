"""Shared by the server tests: the tiny served model and its random head (fixtures: import them into a test
module), servers on loopback ports, the plain-decoding reference and small HTTP helpers. A server with API keys
is called with its first key (the helpers read it from the server's state)."""
import json
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from heads import save_random_head
from tiny import make_tiny_tokenizer

from peagle import LLM, SamplingParams
from peagle import client as client_http

K = 3


# a real uvicorn on a loopback port, in a background thread of the test process
class BackgroundServer:
    def __init__(self, state, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        from peagle.server.app import create_app
        from peagle.server.start import make_server
        self.state = state
        self.app = create_app(state)
        self.server = make_server(self.app, state, host=host, port=port, log_level=log_level, access_log=False,
                                  lifespan="on")
        self.thread = threading.Thread(target=self.server.run, name="peagle-uvicorn", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 15.0):
        self.server.handle_exit(signal.SIGTERM, None)         # as a signal would: the engine loop drains first
        self.thread.join(timeout)
        self.state.loop.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *a):
        self.stop()


@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("serve") / "tiny")
    shutil.copytree(tiny_dirs["llama"], d)       # the session's tiny Llama, plus a tokenizer with a chat template
    make_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    return save_random_head(model_dir, str(tmp_path_factory.mktemp("serve-head") / "p"), layers=2)


@pytest.fixture(scope="module")
def ref_llm(model_dir):
    return LLM(model_dir)


def spec_cfg(head):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": K, "parallel_drafting": True}


def start(model_dir, spec=None, **kw):
    from peagle.server.start import build_state, resolve_config
    m, name, sp = resolve_config(model_dir, json.dumps(spec) if spec else None, env={})
    return BackgroundServer(build_state(m, "tiny", sp, **kw)).start()


# prompts the server tests send (plain text, unicode, code)
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


def auth_headers(srv) -> dict:
    keys = getattr(getattr(srv, "state", None), "api_keys", ())
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def client(srv, retries=0):
    key = auth_headers(srv).get("Authorization", "Bearer none").split(" ", 1)[1]
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=retries, timeout=120)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def ref_complete(llm, prompts, max_tokens, **kw):
    return [o.outputs[0] for o in llm.generate(list(prompts), greedy(max_tokens, **kw))]


def get_json(srv, path):
    return client_http.get_json(srv.url + path, headers=auth_headers(srv))


def get_text(srv, path):
    return client_http.get_text(srv.url + path, headers=auth_headers(srv))


def post(srv, path, body: bytes, headers=None, auth=True):
    """-> (status, parsed JSON body). auth: send the server's key (if it has one); headers may replace it."""
    hs = {"Content-Type": "application/json", **(auth_headers(srv) if auth else {}), **(headers or {})}
    req = urllib.request.Request(srv.url + path, data=body, method="POST", headers=hs)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_idle(srv, timeout=20.0):
    """Seconds until the engine is idle; fails the test after timeout."""
    t0 = time.monotonic()
    idle, d = client_http.wait_idle(srv.url, timeout, auth_headers(srv), poll=0.05)
    if not idle:
        raise AssertionError(f"engine not idle after {timeout}s: {d}")
    return time.monotonic() - t0


def stream_completion(c, prompt, max_tokens, extra_body=None, **kw):
    pieces, ids, fin, usage = [], [], None, None
    s = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                             stream_options={"include_usage": True},
                             extra_body={"return_token_ids": True, **(extra_body or {})}, **kw)
    for ch in s:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices:
            pieces.append(ch.choices[0].text)
            ids += ch.choices[0].model_extra.get("token_ids") or []
            fin = ch.choices[0].finish_reason or fin
    return "".join(pieces), ids, fin, usage
