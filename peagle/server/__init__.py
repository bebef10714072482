"""peagle's OpenAI-compatible server: `peagle serve`.

- start.py:    start-up (model, --speculative-config, keys, limits) -> uvicorn; the flags: peagle/cli/serve.py
- protocol.py: request models (JSON that is not valid Unicode: a 400 naming the field), OpenAI-style errors,
               request -> SamplingParams
- prompt.py:   request -> prompt token ids (completions, chat template)
- limits.py:   per-request limits (body size, prompt tokens, max_tokens and its default, stop strings and ids)
- auth.py:     API keys (--api-key, $PEAGLE_API_KEY, $VLLM_API_KEY): Bearer tokens compared in constant time
- loop.py:     the engine loop thread (the only thread touching the engine): continuous batching, admission, aborts
- prometheus.py: Prometheus metrics (own registry; vLLM's names for spec-decode counters)
- app.py:      the FastAPI app
"""
