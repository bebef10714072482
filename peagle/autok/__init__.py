"""Choosing K (num_speculative_tokens) per engine step: policies (fixed, vLLM's batch-size schedule, auto),
the live acceptance estimate and the measured step-cost model behind `"num_speculative_tokens": "auto"`."""
