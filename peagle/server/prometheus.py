"""Prometheus metrics on the server's own registry.

Names follow vLLM where vLLM has the metric (same meaning): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total{finished_reason}`, `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds` (time between successive outputs of a request: one observation per engine
step that gave it tokens, as vLLM does), `vllm:e2e_request_latency_seconds`, and the spec-decode counters
`vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_total`, `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`.
peagle-only metrics use the `peagle:` prefix (HTTP status counts, 429 rejections, aborts, failures, rows), and
the choice of K: `peagle:spec_decode_num_speculative_tokens` (histogram of the K each decode step used, 0 =
a plain step) and, with "auto", the estimates behind the last choice: `peagle:autok_chosen_k`,
`peagle:autok_batch_size`, `peagle:autok_step_seconds_estimate{k}` (cost model),
`peagle:autok_expected_tokens_per_step{k}` and `peagle:autok_acceptance_estimate{position}`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()          # no *_created series (as vLLM)
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        L = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", L, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced", L,
                                         registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason",
                                L + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from HTTP arrival)", L,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive outputs of a request",
                             L, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", L,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.http = Counter("peagle:http_requests", "HTTP responses by route and status", ["route", "status"],
                            registry=r)
        self.rejected = Counter("peagle:requests_rejected", "Requests refused with 429 (queue full)", L,
                                registry=r).labels(model_name)
        self.aborted = Counter("peagle:requests_aborted", "Requests aborted (client gone)", L,
                               registry=r).labels(model_name)
        self.failed = Counter("peagle:requests_failed", "Requests failed by an internal error", L,
                              registry=r).labels(model_name)
        self.loop = None
        r.register(_EngineCollector(self))

    def success(self, reason: str):
        self._success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and spec-decode counters read from the engine loop's per-step snapshot at scrape time."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        loop, name = self.m.loop, self.m.model_name
        if loop is None:
            return
        s = loop.snapshot
        for metric, help_, v in (("vllm:num_requests_running", "Requests in the running batch", s["running"]),
                                 ("vllm:num_requests_waiting", "Requests waiting for a batch row", s["waiting"]),
                                 ("peagle:num_requests_in_flight", "Admitted requests not yet finished",
                                  s["in_flight"]),
                                 ("peagle:cache_rows_in_use", "KV-cache rows held by requests", s["rows_in_use"])):
            g = GaugeMetricFamily(metric, help_, labels=["model_name"])
            g.add_metric([name], v)
            yield g
        sp = s.get("spec")
        if not sp:
            return
        for key, help_ in (("num_drafts", "Number of spec decoding drafts"),
                           ("num_draft_tokens", "Number of draft tokens"),
                           ("num_accepted_tokens", "Number of accepted tokens")):
            c = CounterMetricFamily(f"vllm:spec_decode_{key}", help_, labels=["model_name"])
            c.add_metric([name], sp[key])
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position",
                                labels=["model_name", "position"])
        for i, v in enumerate(sp["num_accepted_tokens_per_pos"]):
            c.add_metric([name, str(i)], v)
        yield c
        g = GaugeMetricFamily("peagle:spec_decode_mean_acceptance_length", "1 + accepted / drafts (cumulative)",
                              labels=["model_name"])
        g.add_metric([name], sp["mean_acceptance_length"])
        yield g
        yield from k_metrics(name, sp)


def k_metrics(name: str, sp: dict):
    """The K used per step (a histogram over K = 0..k_max) and AutoK's estimates behind its last choice."""
    steps = sp.get("num_steps_per_k") or []
    if steps:
        h = HistogramMetricFamily("peagle:spec_decode_num_speculative_tokens",
                                  "Draft tokens per request (K) of each decode step; 0 = a plain decoding step",
                                  labels=["model_name"])
        cum, buckets = 0, []
        for k, n in enumerate(steps):
            cum += n
            buckets.append((str(float(k)), cum))
        h.add_metric([name], buckets + [("+Inf", cum)], sum(k * n for k, n in enumerate(steps)))
        yield h
    pol = sp.get("k_policy") or {}
    if pol.get("mode") != "auto" or "k" not in pol:
        return
    for metric, help_, v in (("peagle:autok_chosen_k", "K chosen for the last decode step", pol["k"]),
                             ("peagle:autok_batch_size", "Batch size of the last decode step", pol["batch_size"])):
        g = GaugeMetricFamily(metric, help_, labels=["model_name"])
        g.add_metric([name], v)
        yield g
    for metric, help_, key, label in (
            ("peagle:autok_step_seconds_estimate", "Cost model: seconds per step at the last batch size, per K",
             "step_time_s", "k"),
            ("peagle:autok_expected_tokens_per_step", "Expected output tokens of a step at the last batch, per K",
             "expected_tokens", "k"),
            ("peagle:autok_acceptance_estimate", "Live acceptance estimate per draft position (conditional)",
             "alpha_per_pos", "position")):
        g = GaugeMetricFamily(metric, help_, labels=["model_name", label])
        for i, v in enumerate(pol.get(key) or []):
            g.add_metric([name, str(i)], v)
        yield g
