"""Choosing K (num_speculative_tokens) per engine step, plugged into the engine's K-policy protocol
(peagle/kpolicy.py): auto K (AutoK), the live acceptance estimate, the measured step-cost model behind
`"num_speculative_tokens": "auto"`, the policy a speculative config asks for (factory.py) and the schedule
`peagle tune` computes (tune.py). Nothing here builds an engine: measurement gets its engines from the caller."""
