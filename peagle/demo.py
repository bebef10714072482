"""`make demo`: the main job on the default target -- SmolLM2-135M-Instruct answering a chat question and a
coding request, plainly and with its P-EAGLE and EAGLE-3 heads (greedy, so all three outputs must be
identical), with tokens/s, acceptance and speedups."""
from __future__ import annotations

import os
import sys
import time

import torch

from .errors import PeagleError
from .llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
from .paths import SETUP_COMMAND
from .sampling import SamplingParams
from .spec_config import speculative_config
from .threads import others_busy

PROMPTS = [("chat prompt", "What is the difference between a list and a tuple in Python?"),
           ("code prompt", "Write a Python function that checks whether a string is a palindrome.")]
K = {"P-EAGLE": 1, "EAGLE-3": 1}      # each head's best static K at c=1 on q4a8, the default (docs/benchmarks/smollm2/report.md)


def _run(llm, ids, sp, label, repeats=1):
    """Best of `repeats` timed runs after a short warm-up; metrics are from the last run."""
    llm.generate({"prompt_token_ids": ids[:8]}, SamplingParams(temperature=0, max_tokens=4))   # warm-up
    dt = float("inf")
    for _ in range(repeats):
        llm.reset_metrics()
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0]
        dt = min(dt, time.perf_counter() - t0)
    m = llm.get_metrics()
    extra = f", mean acceptance length {m['mean_acceptance_length']:.2f}" if m["num_drafts"] else ""
    print(f"  {label:<22} {len(out.token_ids):4d} tokens  {len(out.token_ids) / dt:7.1f} tokens/s{extra}")
    return out, len(out.token_ids) / dt


def busy_cpus(window: float = 0.5) -> float:
    """CPUs other processes keep busy right now (peagle/threads.py: /proc/stat over `window` seconds, Linux), else
    the 1-minute load average, which trails by a minute (right after `make setup` it still counts pip and the
    conversion)."""
    busy = others_busy(window)
    if busy is not None:
        return busy
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def main() -> int:
    # two threads only on an idle machine: under load, OpenMP barriers make 2 threads several times slower
    threads = 2 if (os.cpu_count() or 1) >= 2 and busy_cpus() < 0.8 else 1
    torch.set_num_threads(threads)
    print(f"(torch threads: {threads}; one timed run each after a warm-up)")
    model = DEFAULT_MODEL
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise PeagleError(f"the default target {model} is not converted yet: run `{SETUP_COMMAND}`")
    sp = SamplingParams(temperature=0, max_tokens=128)
    base = LLM(model)         # quantization "auto": the fastest plain decoding here (stated on stderr)
    print(f"(target: {getattr(base.engine.target, 'precision', 'float weights').split(';')[0]})")
    heads = [(n, h, p) for n, h, p in (("P-EAGLE", DEFAULT_PEAGLE_HEAD, True), ("EAGLE-3", DEFAULT_EAGLE3_HEAD, False))
             if os.path.isfile(os.path.join(h, "config.json"))]
    spec = {n: base.with_speculative_config(speculative_config(h, K[n], p)) for n, h, p in heads}   # one target
    for title, question in PROMPTS:
        ids = base.apply_chat_template([{"role": "user", "content": question}])
        print(f"\n=== {title} ===\nUser: {question}")
        ref, tps = _run(base, ids, sp, "plain decoding")
        print(ref.text)
        print("---")
        rates = {"plain": tps}
        for name, llm in spec.items():
            out, rates[name] = _run(llm, ids, sp, f"{name} (K={K[name]})")
            same = "identical to plain decoding" if out.token_ids == ref.token_ids else "DIFFERS FROM PLAIN DECODING"
            print(f"  {'':<22} output {same}")
        for name in spec:
            line = f"  {name} speedup: {rates[name] / rates['plain']:.2f}x over plain decoding"
            if name == "P-EAGLE" and "EAGLE-3" in rates:
                line += f", {rates['P-EAGLE'] / rates['EAGLE-3']:.2f}x over EAGLE-3"
            print(line)
    if not spec:
        print(f"\n(no drafter heads found next to the default target: {DEFAULT_PEAGLE_HEAD}, {DEFAULT_EAGLE3_HEAD}; "
              "speculative demo skipped)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PeagleError as e:
        print(f"peagle: error: {e}", file=sys.stderr)
        sys.exit(1)
