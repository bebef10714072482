"""Client-side helpers for benchmarks and load tests against `peagle serve` (or any vLLM-style server):
start the server in a subprocess, read JSON / Prometheus metrics, stream one request with the `openai` client.

Invariant: the client knows the server only from outside (HTTP, and `python -m peagle.cli serve` as a
subprocess); it imports no server module, so benchmarks and tests use it without the server's dependencies."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from .paths import CHECKOUT, REPO
from .spec_metrics import SpecMetrics

# the environment variables an API key comes from (peagle/server/auth.py reads them; a launched server gets none)
ENV_KEYS = ("PEAGLE_API_KEY", "VLLM_API_KEY")


def get_text(url, timeout=30, headers=None) -> str:
    """The body of GET url (headers: e.g. an API key's Authorization)."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return r.read().decode()


def get_json(url, timeout=30, headers=None):
    return json.loads(get_text(url, timeout, headers))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model, spec: str | None, max_num_seqs: int, extra=(), timeout: float = 300, env=None, cwd=None):
    """`peagle serve MODEL` (model None or "demo": the embedded default) on a free loopback port, without API keys
    (a key in the environment, e.g. $VLLM_API_KEY, is not passed on: the clients here send none); cwd: the
    checkout whose peagle runs (default: the peagle imported here, run from the caller's directory, so relative
    model and head paths mean what they mean here). Returns (process, base url) once /health answers; raises
    RuntimeError if it exits or never comes up."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in ENV_KEYS}
    env["PYTHONSAFEPATH"] = "1"       # -m must not import a `peagle` (or stdlib name) from the directory
    root = cwd if cwd is not None else REPO if CHECKOUT else None
    if root is not None:              # that checkout's peagle first, whatever directory the server starts in
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(root)] + [x for x in [env.get("PYTHONPATH")] if x])
    port = free_port()
    cmd = [sys.executable, "-m", "peagle.cli", "serve"] + ([] if model in (None, "demo") else [model])
    cmd += ["--port", str(port), "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *extra]
    if spec:
        cmd += ["--speculative-config", spec]
    p = subprocess.Popen(cmd, cwd=cwd, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            if p.poll() is not None:
                raise RuntimeError(f"server exited with {p.returncode}: {' '.join(cmd)}")
            try:
                if get_json(url + "/health", 5).get("status") == "ok":
                    return p, url
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server did not come up in {timeout:.0f} s: {' '.join(cmd)}")
    except BaseException:              # not up (or interrupted while waiting): no server left behind
        stop(p)
        raise


def stop(p, timeout: float = 30):
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def wait_idle(url, timeout=60, headers=None, poll=0.1):
    """(idle?, /debug/engine) once no rows, waiting or in-flight requests remain (or the timeout passes)."""
    t0 = time.monotonic()
    d = None
    while time.monotonic() - t0 < timeout:
        d = get_json(url + "/debug/engine", headers=headers)
        if d["rows_in_use"] == 0 and d["waiting"] == 0 and d["in_flight"] == 0:
            return True, d
        time.sleep(poll)
    return False, d


def spec_counters(url) -> dict | None:
    """The server's cumulative spec-decode counters (vLLM metric names): num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos, and num_steps_per_k (from peagle's histogram of the K
    per step). None for a server without speculation."""
    vals, per_pos, cum = {}, {}, {}
    for ln in get_text(url + "/metrics").splitlines():
        if ln.startswith("peagle:spec_decode_num_speculative_tokens_bucket") and 'le="+Inf"' not in ln:
            name, v = ln.rsplit(" ", 1)
            cum[int(float(name.split('le="', 1)[1].split('"', 1)[0]))] = float(v)
        if not ln.startswith("vllm:spec_decode_"):
            continue
        name, v = ln.rsplit(" ", 1)
        if name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = float(v)
            continue
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if name.startswith(f"vllm:spec_decode_{key}_total"):
                vals[key] = vals.get(key, 0.0) + float(v)
    if not vals:
        return None
    vals["num_accepted_tokens_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    vals["num_steps_per_k"] = [cum[k] - cum.get(k - 1, 0.0) for k in sorted(cum)]
    return vals


def counters_delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    b = before or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    pp_b = b["num_accepted_tokens_per_pos"]
    m = SpecMetrics(len(after["num_accepted_tokens_per_pos"]))
    m.num_accepted_tokens_per_pos = [a - (pp_b[i] if i < len(pp_b) else 0)
                                     for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
    m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens = (
        after[k] - b[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    st_b = b.get("num_steps_per_k") or []
    if len(after.get("num_steps_per_k") or []) == len(m.num_steps_per_k):
        m.num_steps_per_k = [a - (st_b[i] if i < len(st_b) else 0) for i, a in enumerate(after["num_steps_per_k"])]
    return m.as_dict()


async def stream_one(client, model, prompt, max_tokens, chat=False, timeout=900, **extra) -> dict:
    """One streaming request. prompt: text, token ids (completions) or a user message (chat). Returns the
    text, the token ids (vLLM's return_token_ids), finish reason, time to first token and latency (s)."""
    t0 = time.perf_counter()
    ttft, pieces, ids, fin = None, [], [], None
    body = {"return_token_ids": True, **extra.pop("extra_body", {})}
    kw = dict(model=model, max_tokens=max_tokens, stream=True, extra_body=body, timeout=timeout, **extra)
    kw.setdefault("temperature", 0)
    if chat:
        s = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        s = await client.completions.create(prompt=prompt, **kw)
    async for ch in s:
        if not ch.choices:
            continue
        c = ch.choices[0]
        new = (c.model_extra or {}).get("token_ids") or []
        if new and ttft is None:
            ttft = time.perf_counter() - t0
        ids += new
        pieces.append((c.delta.content or "") if chat else c.text)
        fin = c.finish_reason or fin
    return {"text": "".join(pieces), "ids": ids, "finish": fin, "ttft": ttft, "latency": time.perf_counter() - t0}
