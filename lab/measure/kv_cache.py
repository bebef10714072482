"""A float32 KV cache against a bfloat16 one (`--kv-cache-dtype bfloat16`), side by side in one process on the
default target: decode time per token by context length, and what the rounding costs in quality.

A decode step's attention reads every cached key and value: 46 KB per position for SmolLM2 in float32 (30 layers,
3 kv heads x 64, k and v), so at 2,048 positions more bytes than its 4-bit weights. bfloat16 halves them.

Per context length (a prompt of that many tokens of peagle's own source, then --max-new greedy tokens, ignore
EOS): the decode steps' time per token (the engine's draft and verify time, prefill excluded), min over --rounds, the two
caches alternating within each round; plain decoding, and P-EAGLE K=1 (the shipped head) with its acceptance.
Quality: the perplexity of each cache on held-out text (HumanEval's prompts + solutions, joined into one
--ppl-len-token sequence: the long-context case) and the top-1 agreement of the bfloat16 run with the float32
one; and the greedy tokens of the two caches compared.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/kv_cache.py --out docs/benchmarks/kv-cache.md

Quick check that it runs (numbers meaningless): --contexts 16,64 --max-new 8 --rounds 1 --ppl-len 64.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.cpu_step import heldout_texts, perplexity
from lab.measure.precision import cpu_flags, write_report
from peagle.llm import DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
from peagle.sampling import SamplingParams

KINDS = ("float32", "bfloat16")


def source_ids(tok) -> list[int]:
    from peagle.paths import HOME
    text = "".join(open(f).read() for f in sorted(glob.glob(os.path.join(HOME, "peagle", "*.py"))))
    return tok(text)["input_ids"]


def decode_ms(llm: LLM, ids: list[int], max_new: int) -> tuple[float, list[int], dict]:
    """ms per token of the decode steps (drafting and verifying; prefill and its first token excluded), the
    tokens, the engine's metrics."""
    llm.reset_metrics()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=max_new,
                                                                   ignore_eos=True))
    m = llm.get_metrics()
    return (m["verify_time_s"] + m["draft_time_s"]) * 1e3 / max(max_new - 1, 1), out[0].outputs[0].token_ids, m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--head", default=DEFAULT_PEAGLE_HEAD)
    ap.add_argument("--contexts", default="64,512,1024,2048,4000")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ppl-len", type=int, default=2048)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    llms = {k: LLM(a.model, kv_cache_dtype=k, max_num_seqs=1) for k in KINDS}
    spec = {"method": "eagle3", "model": a.head, "num_speculative_tokens": 1, "parallel_drafting": True}
    peagle = {k: llms[k].with_speculative_config(spec) for k in KINDS}
    ids = source_ids(llms["float32"].tokenizer)
    if len(ids) < max(contexts):
        raise SystemExit(f"peagle's source is {len(ids)} tokens, shorter than context {max(contexts)}")
    best = {(k, m, c): float("inf") for k in KINDS for m in ("plain", "peagle") for c in contexts}
    toks, acc = {}, {}
    for c in contexts:                       # a warm-up per context (the caches grow to it once)
        for k in KINDS:
            decode_ms(llms[k], ids[:c], 4)
    for r in range(a.rounds):
        for c in contexts:
            for k in (KINDS if r % 2 == 0 else KINDS[::-1]):
                for m, llm in (("plain", llms[k]), ("peagle", peagle[k])):
                    ms, t, met = decode_ms(llm, ids[:c], a.max_new)
                    best[k, m, c] = min(best[k, m, c], ms)
                    toks[k, m, c] = t
                    if m == "peagle":
                        acc[k, c] = met["mean_acceptance_length"]
            print(f"round {r + 1} context {c}: " + ", ".join(
                f"{k} {m} {best[k, m, c]:.2f} ms" for k in KINDS for m in ("plain", "peagle")),
                file=sys.stderr, flush=True)
    # quality: one long held-out sequence through each cache
    tok = llms["float32"].tokenizer
    text = [t for x in heldout_texts(400, tok) for t in x][:a.ppl_len]
    ppl, agree = {}, None
    ref = None
    for k in KINDS:
        p, ag, am, n = perplexity(llms[k].engine.target, [text], ref)
        ppl[k] = p
        if ref is None:
            ref = am
        else:
            agree = ag
    lines = [f"# float32 vs bfloat16 KV cache, {os.path.basename(a.model.rstrip('/'))} "
             f"({llms['float32'].engine.target.precision.split(':')[0]})", "",
             f"CPU: {cpu_flags()}, {torch.get_num_threads()} torch threads. Decode time per generated token "
             f"(drafting and verifying; prefill excluded), min of {a.rounds} rounds, {a.max_new} greedy tokens after "
             "a prompt of the context's length; the two caches alternate within each round.", "",
             "| context | plain f32 KV | plain bf16 KV | bf16 speed-up | P-EAGLE K=1 f32 KV | P-EAGLE K=1 bf16 KV "
             "| bf16 speed-up | AL f32 / bf16 | plain tokens f32 = bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in contexts:
        f, b = best["float32", "plain", c], best["bfloat16", "plain", c]
        pf, pb = best["float32", "peagle", c], best["bfloat16", "peagle", c]
        ta, tb = toks["float32", "plain", c], toks["bfloat16", "plain", c]
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        lines.append(f"| {c} | {f:.2f} ms | {b:.2f} ms | {f / b:.2f}x | {pf:.2f} ms | {pb:.2f} ms | {pf / pb:.2f}x "
                     f"| {acc['float32', c]:.2f} / {acc['bfloat16', c]:.2f} | "
                     + ("yes" if same is None else f"first {same} of {len(ta)}") + " |")
    lines += ["", "AL: P-EAGLE's tokens per step. With either cache P-EAGLE's tokens are plain decoding's "
              "(tests/test_kv_cache.py).", "",
              f"Quality on {len(text)} held-out tokens (HumanEval prompts + solutions, one sequence): perplexity "
              f"float32 KV {ppl['float32']:.4f}, bfloat16 KV {ppl['bfloat16']:.4f}; bfloat16's top-1 agrees with "
              f"float32's at {100 * agree:.2f} % of positions."]
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/kv_cache.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
