"""`peagle serve`: an OpenAI-compatible HTTP server (completions, chat, streaming, metrics) with vLLM's
--speculative-config (the flags; the start-up: peagle/server/start.py)."""
from __future__ import annotations

import argparse

from ..compile import add_argument
from ..device import add_arguments
from ..models.loader import add_backend_argument, add_kv_cache_argument, add_quantization_argument
from ..server.start import ENV_SPEC, SERVE_K, run


def _port(s: str) -> int:
    p = int(s)
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {p}")
    return p


def add_parser(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible server (vLLM's --speculative-config)",
                       description="Serve a model over an OpenAI-compatible HTTP API with continuous batching and "
                                   "optional speculative decoding. With no MODEL: the default target "
                                   f"(SmolLM2-135M-Instruct) with its P-EAGLE head (K={SERVE_K}: chosen per step "
                                   "from step costs measured once per machine at the first start).")
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--speculative-config", default=None,
                   help='vLLM JSON, e.g. \'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 7, '
                        f'"parallel_drafting": true}}\'; also from ${ENV_SPEC} (the flag wins); "none" turns '
                        "speculation off")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="(default 8000)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="rows in the running batch (default 128)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests that may wait for a row beyond --max-num-seqs (default 4x max-num-seqs); "
                        "more get HTTP 429")
    p.add_argument("--max-model-len", type=int, default=None)
    add_arguments(p)
    add_argument(p)
    add_backend_argument(p)
    add_quantization_argument(p)
    add_kv_cache_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL as given)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health and /metrics; repeatable "
                        "or comma-separated; also from $PEAGLE_API_KEY or $VLLM_API_KEY (the flag wins)")
    g = p.add_argument_group("request limits (over a limit: HTTP 4xx naming the parameter)")
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body size (default 8 MiB)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt tokens (default: the context)")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="the largest max_tokens a request may ask for (default: the rest of the context)")
    g.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens for requests that give none (default: OpenAI's 16 for completions; for chat "
                        "--max-tokens-limit, else the rest of the context; never above --max-tokens-limit)")
    g.add_argument("--max-stop", type=int, default=16, help="stop strings, and stop_token_ids, per request (default 16)")
    g.add_argument("--max-stop-chars", type=int, default=512, help="characters per stop string (default 512)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true")
    p.set_defaults(func=run)
