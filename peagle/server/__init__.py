"""peagle's OpenAI-compatible server: `peagle serve`.

- cli.py:      the `peagle serve` command line (model, --speculative-config, limits) -> uvicorn

- protocol.py: request models, OpenAI-style errors, request -> SamplingParams
- detok.py:    incremental detokenization for streaming (holds back partial UTF-8 and stop-string prefixes)
- loop.py:     the engine loop thread (the only thread touching the engine): continuous batching, admission, aborts
- prometheus.py: Prometheus metrics (own registry; vLLM's names for spec-decode counters)
- app.py:      the FastAPI app
- runner.py:   run the server in a background thread (tests, benchmarks)
"""
