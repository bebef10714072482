"""Online runs: the same encoded prompts through `peagle serve` over HTTP, like `vllm bench serve
--max-concurrency c`. One server subprocess per (method, K) serves every dataset and concurrency; c async
clients (the official `openai` client, streaming /v1/completions with token-id prompts) keep c requests in
flight. TTFT and TPOT are measured at the client; acceptance comes from the server's /metrics counters."""
from __future__ import annotations

import asyncio
import json
import os
import time

from .. import client as C
from ..spec_config import AUTO, DEFAULT_DRAFT_SAMPLING, speculative_config
from .runner import out_hash, stats_ms


def spec_json(method: str, k: int, head: str | None, draft_sampling: str = DEFAULT_DRAFT_SAMPLING,
              auto_k=None) -> str | None:
    """The server's speculative config: the offline runs' settings (draft sampling, auto K's knobs) included."""
    if method == "baseline":
        return None
    cfg = speculative_config(head, k, method == "peagle")
    if draft_sampling != DEFAULT_DRAFT_SAMPLING:
        cfg["draft_sampling"] = draft_sampling
    if k == AUTO and auto_k is not None and auto_k.as_dict():
        cfg["auto_k"] = auto_k.as_dict()
    return json.dumps(cfg)


class OnlineServer:
    """`peagle serve` in a subprocess for one (method, K); use as a context manager."""

    def __init__(self, model: str, method: str, k: int, head: str | None, max_num_seqs: int, max_model_len: int,
                 dtype: str = "auto", seed: int = 0, device: str = "auto", compile: bool = False,
                 target_backend: str = "auto", quantization: str = "none", threads: int = 0,
                 draft_sampling: str = DEFAULT_DRAFT_SAMPLING, auto_k=None, kv_cache_dtype: str = "auto"):
        """threads: the server's torch threads (0: torch's default), as the offline runs' --threads."""
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
        self.args = (model, spec_json(method, k, head, draft_sampling, auto_k), max_num_seqs,
                     ["--max-model-len", str(max_model_len), "--device", device, "--dtype", dtype, "--seed", str(seed),
                      "--target-backend", target_backend, "--quantization", quantization,
                      "--kv-cache-dtype", kv_cache_dtype,
                      "--max-waiting", str(4 * max_num_seqs), "--served-model-name", "bench"]
                     + (["--compile"] if compile else []))
        self.proc, self.url = None, None

    def __enter__(self):
        model, spec, n, extra = self.args
        self.proc, self.url = C.launch(model, spec, n, extra, env=self.env)
        return self

    def __exit__(self, *exc):
        C.stop(self.proc)


async def _clients(url, prompts_ids, c, max_tokens, temperature, ignore_eos, timeout):
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    sem = asyncio.Semaphore(c)
    extra = {"extra_body": {"ignore_eos": True}} if ignore_eos else {}

    async def one(ids):
        async with sem:
            return await C.stream_one(client, "bench", ids, max_tokens, timeout=timeout,
                                      temperature=temperature, **extra)
    t0 = time.perf_counter()
    res = await asyncio.gather(*[one(ids) for ids in prompts_ids], return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.close()
    return res, wall


def run_online(srv: OnlineServer, method: str, k: int, c: int, prompts_ids: list, max_tokens: int,
               temperature: float = 0.0, ignore_eos: bool = False, timeout: float = 1800) -> dict:
    """One online run; the result has the offline run's shape (plus "errors"), without the drafter/verify
    timing split (that lives in the server process)."""
    before = C.spec_counters(srv.url)
    res, wall = asyncio.run(_clients(srv.url, prompts_ids, c, max_tokens, temperature, ignore_eos, timeout))
    idle, dbg = C.wait_idle(srv.url)
    spec = C.counters_delta(C.spec_counters(srv.url), before)
    errors = [f"{type(r).__name__}: {r}" for r in res if isinstance(r, BaseException)]
    ok = [r for r in res if not isinstance(r, BaseException)]
    per_req = [{"id": i, "prompt_len": len(ids), "output_len": len(r["ids"]), "finish_reason": r["finish"],
                "ttft_s": r["ttft"], "e2e_s": r["latency"],
                "tpot_s": (r["latency"] - r["ttft"]) / (len(r["ids"]) - 1)
                if r["ttft"] is not None and len(r["ids"]) > 1 else None, "hash": out_hash(r["ids"])}
               for i, (ids, r) in enumerate(zip(prompts_ids, res)) if not isinstance(r, BaseException)]
    total = sum(len(r["ids"]) for r in ok)
    metrics = spec or {"num_drafts": 0, "mean_acceptance_length": 1.0, "acceptance_rate_per_pos": []}
    return {"method": method, "k": k, "mean_k": metrics.get("mean_num_speculative_tokens"), "concurrency": c,
            "mode": "online", "n_requests": len(prompts_ids),
            "output_tokens": total, "wall_s": wall, "output_tok_s": total / wall, "req_s": len(ok) / wall,
            "ttft_ms": stats_ms([r["ttft_s"] for r in per_req]), "tpot_ms": stats_ms([r["tpot_s"] for r in per_req]),
            "e2e_ms": stats_ms([r["e2e_s"] for r in per_req]), "metrics": metrics, "errors": errors,
            "server_idle_after": idle, "server_step_errors": dbg.get("step_errors") if dbg else None,
            "requests": per_req, "_outputs": [r["ids"] if not isinstance(r, BaseException) else None for r in res]}
