"""peagle/client.py: the spec-decode counters read from a server's /metrics (vLLM's names) and their difference
between two reads, as `peagle bench --mode online` reports a run."""
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from peagle.client import counters_delta, spec_counters

METRICS = """# HELP vllm:spec_decode_num_drafts_total drafts
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0
peagle:spec_decode_num_speculative_tokens_bucket{le="0.0"} 2.0
peagle:spec_decode_num_speculative_tokens_bucket{le="1.0"} 2.0
peagle:spec_decode_num_speculative_tokens_bucket{le="2.0"} 5.0
peagle:spec_decode_num_speculative_tokens_bucket{le="3.0"} 15.0
peagle:spec_decode_num_speculative_tokens_bucket{le="+Inf"} 15.0
"""


def test_spec_counters_reads_the_k_histogram_per_k():
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = spec_counters(f"http://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()
        srv.server_close()
    assert c == {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 12.0,
                 "num_accepted_tokens_per_pos": [7.0, 4.0, 1.0], "num_steps_per_k": [2.0, 0.0, 3.0, 10.0]}


def test_counters_delta_is_the_run_alone():
    before = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
              "num_accepted_tokens_per_pos": [3, 2, 1], "num_steps_per_k": [1, 0, 1, 3]}
    after = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
             "num_accepted_tokens_per_pos": [7, 4, 1], "num_steps_per_k": [2, 0, 3, 10]}
    d = counters_delta(after, before)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (6, 18, 6)
    assert d["num_accepted_tokens_per_pos"] == [4, 2, 0]
    assert d["num_steps_per_k"] == [1, 0, 2, 7]
    assert counters_delta(None, before) is None
