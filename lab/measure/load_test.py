"""Load test for `peagle serve`: N concurrent streaming clients (default 128), greedy, checked token for token
against plain decoding (peagle's LLM without speculation, run here on the same model directory).

    # against a running server (its model directory is read from /v1/models "root"):
    python lab/measure/load_test.py --url http://127.0.0.1:8000
    # start `peagle serve` in a subprocess first (and stop it afterwards):
    python lab/measure/load_test.py --launch models/demo-target --speculative-config '{"method": "eagle3", ...}'
    python lab/measure/load_test.py --launch demo                    # the default target with its P-EAGLE head
    # a tiny random model + tokenizer + random P-EAGLE head (built under --tiny-dir), served with speculation:
    python lab/measure/load_test.py --tiny

Passes (exit 0) when: zero errors, every output identical to plain decoding (token ids and text), and no cache
rows / requests left in the engine afterwards (GET /debug/engine). Prints p50/p99 end-to-end latency and time
to first token, output tokens/s, and the server's spec-decode acceptance (from /metrics)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from peagle.bench.summary import percentile
from peagle.client import get_json, get_text, launch, spec_counters, stop, stream_one, wait_idle

TOPICS = ["the ocean", "a small robot", "speculative decoding", "the history of bread", "a rainy city",
          "prime numbers", "an old lighthouse", "the moon", "learning to cook", "a chess game", "mountain trails",
          "a jazz band", "the first computer", "desert plants", "a lost key", "winter mornings"]
STYLES = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
          "Describe {} in one paragraph.", "Write a poem about {}.", "What is interesting about {}?",
          "Give advice related to {}.", "Summarize what you know about {}."]


def make_prompts(n):
    return [STYLES[(i // len(TOPICS)) % len(STYLES)].format(TOPICS[i % len(TOPICS)]) + ("" if i < 128 else f" ({i})")
            for i in range(n)]


def pct(xs, q):
    p = percentile(xs, q)
    return float("nan") if p is None else p


def build_tiny(d):
    from peagle.heads.init import random_head
    from peagle.models.tiny import make_tiny_tokenizer, save_tiny
    if not os.path.exists(os.path.join(d, "target", "tokenizer.json")):
        save_tiny("llama", os.path.join(d, "target"))
        make_tiny_tokenizer(os.path.join(d, "target"))
    if not os.path.exists(os.path.join(d, "head", "config.json")):
        random_head(os.path.join(d, "target"), os.path.join(d, "head"), layers=2, mask_token=4)
    spec = {"method": "eagle3", "model": os.path.join(d, "head"), "num_speculative_tokens": 3,
            "parallel_drafting": True}
    return os.path.join(d, "target"), json.dumps(spec)


# ---------------------------------------------------------------- reference
def reference(model_dir, prompts, max_tokens, chat, max_num_seqs=128):
    from peagle import LLM, SamplingParams
    llm = LLM(model_dir, max_num_seqs=max_num_seqs)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
    else:
        outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"reference (plain decoding, one batch in this process): {ntok} tokens in {dt:.1f} s "
          f"= {ntok / dt:.0f} tokens/s", flush=True)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


# ---------------------------------------------------------------- load
async def run_load(url, model, prompts, max_tokens, chat, timeout):
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    t0 = time.perf_counter()
    res = await asyncio.gather(*[stream_one(client, model, p, max_tokens, chat, timeout) for p in prompts],
                               return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.close()
    return res, wall


def server_hist(url):
    """(sum, count) of the server's TTFT / ITL / e2e histograms (measured from HTTP arrival)."""
    out = {}
    for ln in get_text(url + "/metrics").splitlines():
        for key in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
            for part in ("_sum", "_count"):
                if ln.startswith(f"vllm:{key}{part}"):
                    out[key + part] = out.get(key + part, 0.0) + float(ln.rsplit(" ", 1)[1])
    return out


def spec_summary(url):
    c = spec_counters(url)
    return None if not c or not c["num_drafts"] else (c["num_drafts"], c["num_accepted_tokens"],
                                                      1 + c["num_accepted_tokens"] / c["num_drafts"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    g.add_argument("--launch", metavar="MODEL", help="start `peagle serve MODEL` (or 'demo') in a subprocess")
    g.add_argument("--tiny", action="store_true", help="build and serve a tiny random model with a random head")
    ap.add_argument("--tiny-dir", default=os.path.join(tempfile.gettempdir(), "peagle-load-tiny"))
    ap.add_argument("--speculative-config", default=None, help="with --launch")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="with --launch/--tiny")
    ap.add_argument("--model-dir", default=None, help="model directory for the reference (default: /v1/models root)")
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default: /v1/completions)")
    ap.add_argument("--timeout", type=float, default=900, help="per-request timeout, seconds")
    ap.add_argument("--no-verify", action="store_true", help="skip the plain-decoding reference")
    a = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    proc, url = None, a.url
    model_dir = a.model_dir
    prompts = make_prompts(a.clients)
    try:
        if a.tiny:
            model_dir, spec = build_tiny(a.tiny_dir)
            a.launch, a.speculative_config = model_dir, spec
        if a.launch:
            # reference first, so the server and the reference never share the CPU
            if not a.no_verify and a.launch != "demo":
                refs = reference(model_dir or a.launch, prompts, a.max_tokens, a.chat, a.max_num_seqs)
            print(f"launch: peagle serve {a.launch} --max-num-seqs {a.max_num_seqs}", flush=True)
            proc, url = launch(a.launch, a.speculative_config, a.max_num_seqs)
        if url is None:
            url = "http://127.0.0.1:8000"
        info = get_json(url + "/v1/models")["data"][0]
        model = info["id"]
        model_dir = model_dir or info.get("root")
        dbg = get_json(url + "/debug/engine")
        print(f"server {url}: model {model} ({model_dir}), speculative={dbg.get('speculative')}, "
              f"max_num_seqs={dbg['max_num_seqs']}", flush=True)
        if not a.no_verify and not (a.launch and a.launch != "demo"):
            refs = reference(model_dir, prompts, a.max_tokens, a.chat, a.max_num_seqs)
        spec0 = spec_summary(url)
        h0 = server_hist(url)
        print(f"load: {a.clients} concurrent streaming clients, max_tokens={a.max_tokens}, greedy, "
              f"{'chat' if a.chat else 'completions'}", flush=True)
        res, wall = asyncio.run(run_load(url, model, prompts, a.max_tokens, a.chat, a.timeout))
        errors = [(i, r) for i, r in enumerate(res) if isinstance(r, BaseException)]
        ok = [r for r in res if not isinstance(r, BaseException)]
        mismatches = []
        if not a.no_verify:
            for i, r in enumerate(res):
                if not isinstance(r, BaseException) and (r["ids"] != refs[i][1] or r["text"] != refs[i][0]):
                    mismatches.append(i)
        idle, dbg = wait_idle(url)
        ntok = sum(len(r["ids"]) for r in ok)
        lat = [r["latency"] for r in ok]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        print(f"requests: {len(ok)} ok, {len(errors)} errors, "
              f"{'not checked' if a.no_verify else f'{len(mismatches)} differ from plain decoding'}")
        print(f"latency   p50 {pct(lat, 50):.2f} s   p99 {pct(lat, 99):.2f} s   max {max(lat, default=0):.2f} s")
        print(f"TTFT      p50 {pct(ttft, 50):.2f} s   p99 {pct(ttft, 99):.2f} s")
        print(f"output    {ntok} tokens in {wall:.2f} s = {ntok / wall:.1f} tokens/s  "
              f"({len(ok) / wall:.2f} requests/s)")
        h1 = server_hist(url)

        def mean(k):
            n = h1.get(k + "_count", 0) - h0.get(k + "_count", 0)
            return (h1.get(k + "_sum", 0) - h0.get(k + "_sum", 0)) / n if n else float("nan")
        print(f"server    mean TTFT {mean('time_to_first_token_seconds'):.2f} s, mean inter-token latency "
              f"{mean('inter_token_latency_seconds') * 1000:.0f} ms, mean e2e {mean('e2e_request_latency_seconds'):.2f} s"
              f" (from HTTP arrival)")
        s1 = spec_summary(url)
        if s1:
            d = s1[0] - (spec0[0] if spec0 else 0)
            acc = s1[1] - (spec0[1] if spec0 else 0)
            if d:
                print(f"spec      {int(d)} drafts, mean acceptance length {1 + acc / d:.2f} (this run)")
        print(f"engine    after: rows_in_use={dbg['rows_in_use']} waiting={dbg['waiting']} "
              f"in_flight={dbg['in_flight']} step_errors={dbg['step_errors']}")
        for i, e in errors[:5]:
            print(f"  error {i}: {type(e).__name__}: {e}")
        for i in mismatches[:5]:
            print(f"  mismatch {i}: {prompts[i]!r}\n    got  {res[i]['ids'][:24]}\n    want {refs[i][1][:24]}")
        passed = not errors and not mismatches and idle
        print("PASS" if passed else "FAIL")
        return 0 if passed else 1
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
