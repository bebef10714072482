"""`make demo`: the main job on the embedded default — the demo target generating code and chat, plainly and
with its P-EAGLE and EAGLE-3 heads (greedy, so all three outputs must be identical), with tokens/s and speedups."""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from .llm import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
from .sampling import SamplingParams
from .spec_config import speculative_config

# no trailing newline: this byte-level BPE merges "\n" with the next line's indentation, so a prompt that
# ends in a bare "\n" is off-distribution (see models/demo-target/README.md)
CODE = 'def read_csv(path):\n    """Read a CSV file and return a list of rows."""'
# a ShareGPT-style coding question, like the chat half of the corpus; this target's greedy chat answers open
# with a chat-like sentence and then repeat themselves (models/demo-target/README.md)
CHAT = [{"role": "user", "content": "What is the difference between a list and a tuple in Python?"}]
K = 7


def _run(llm, ids, sp, label, repeats=3):
    """Best of `repeats` timed runs (the machine is shared and noisy); metrics are from the last run."""
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


def main() -> int:
    # two threads only on an idle machine: under load, OpenMP barriers make 2 threads several times slower
    threads = 2 if (os.cpu_count() or 1) >= 2 and os.getloadavg()[0] < 0.8 else 1
    torch.set_num_threads(threads)
    print(f"(torch threads: {threads}; timings are the best of 3 runs)")
    model = DEFAULT_MODEL
    if not os.path.isfile(os.path.join(model, "config.json")):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
        from tiny import save_tiny_text_model
        model = save_tiny_text_model(os.path.join(tempfile.mkdtemp(), "tiny"))
        print(f"NOTE: the embedded demo target ({DEFAULT_MODEL}) is not built yet: using a tiny RANDOM model "
              f"built like the tests do ({model}). Its text is gibberish.")
    sp = SamplingParams(temperature=0, max_tokens=128)
    base = LLM(model)
    heads = [(n, h, p) for n, h, p in (("P-EAGLE", DEFAULT_PEAGLE_HEAD, True), ("EAGLE-3", DEFAULT_EAGLE3_HEAD, False))
             if model == DEFAULT_MODEL and os.path.isfile(os.path.join(h, "config.json"))]
    spec = {n: LLM(model, speculative_config=speculative_config(h, K, p)) for n, h, p in heads}
    for title, ids in (("code prompt", base.tokenizer(CODE, add_special_tokens=False)["input_ids"]),
                       ("chat prompt", base.apply_chat_template(CHAT))):
        print(f"\n=== {title} ===")
        print(base.tokenizer.decode(ids, skip_special_tokens=False) if title == "chat prompt" else CODE)
        ref, tps = _run(base, ids, sp, "plain decoding")
        print(ref.text)
        print("---")
        rates = {"plain": tps}
        for name, llm in spec.items():
            out, rates[name] = _run(llm, ids, sp, f"{name} (K={K})")
            same = "identical to plain decoding" if out.token_ids == ref.token_ids else "DIFFERS FROM PLAIN DECODING"
            print(f"  {'':<22} output {same}")
        if "P-EAGLE" in rates:
            line = f"  P-EAGLE speedup: {rates['P-EAGLE'] / rates['plain']:.2f}x over plain decoding"
            if "EAGLE-3" in rates:
                line += f", {rates['P-EAGLE'] / rates['EAGLE-3']:.2f}x over EAGLE-3"
            print(line)
    if not spec:
        print("\n(no shipped drafter heads found next to the demo target: models/demo-target-peagle, "
              "models/demo-target-eagle3; speculative demo skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
