"""Generation throughput of `peagle datagen`: the engine path (LLM.generate, then a separate hidden-state pass
is needed) vs the one-pass path (--hidden-states: peagle/train/selfgen.py) per target precision (float32, bf16:
`datagen --dtype bf16`, and q4: the packaged GGUF's Q4_1 blocks, `datagen --quantization q4`), same prompts,
side by side in one process. Prints generated tokens/s of each and their ratio to the engine path; counts the
answers equal to the engine's.

    .venv/bin/python lab/measure/datagen_speed.py --prompts 64 --max-new 128 --batch 64 --quantizations none,q4
        --workers 2

--workers N adds, per precision, the one-pass path as `datagen --part i/N` runs it: N processes of one thread
each on every N-th prompt with batch --batch, timed together (wall clock from spawn to the slowest, model loads
included) -- on 2 cores two single-thread workers
avoid the OpenMP barriers of one 2-thread process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags
from peagle.heads.config import default_aux_layer_ids
from peagle.llm import DEFAULT_MODEL, LLM
from peagle.models.loader import load_target
from peagle.sampling import SamplingParams
from peagle.train.datagen import build_prompts, prompt_ids
from peagle.train.hidden_states import default_layer_ids
from peagle.train.selfgen import generate_with_states


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--engine-batch", type=int, default=32, help="the shipped recipe's batch for the engine path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quantizations", default="none",
                    help="target precisions of the one-pass path (none,q8,q4; bf16: bfloat16 weights, --dtype bf16)")
    ap.add_argument("--workers", type=int, default=0, help="also run N single-thread worker processes per precision")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    items = build_prompts(a.prompts, 0.3, a.seed, 1)
    llm = LLM(model=a.model, max_num_seqs=a.engine_batch, max_model_len=a.max_prompt + a.max_new + 16,
              quantization="none")                                   # the shipped recipe's path: float32
    tok = llm.get_tokenizer()
    prompts = [p for p in (prompt_ids(tok, llm.apply_chat_template, it) for it in items) if 2 <= len(p) <= a.max_prompt]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=a.max_new))
    t_engine = time.perf_counter() - t
    n_engine = sum(len(o.outputs[0].token_ids) for o in outs)
    base = llm.engine.target
    L = base.cfg.num_hidden_layers
    eos = set(base.cfg.eos_token_ids) | {tok.eos_token_id}
    layers = tuple(default_layer_ids(L, default_aux_layer_ids(L)))
    rows = []
    for q in a.quantizations.split(","):
        target = base if q == "none" else _load(a.model, q)
        got = {}
        res = generate_with_states(target, prompts, a.max_new, eos, layers, batch=a.batch,
                                   emit=lambda i, ids, m, h: got.__setitem__(i, ids[len(prompts[i]):].tolist()))
        same = sum(got[i] == list(o.outputs[0].token_ids) for i, o in enumerate(outs))
        rows.append((q, res["tokens"], res["seconds"], same, 1))
        if a.workers > 1:
            n, sec, same = _workers(a, q, prompts, eos, layers, outs)
            rows.append((q, n, sec, same, a.workers))
    print(f"CPU: {cpu_flags()}, {a.threads} threads; {len(prompts)} prompts, max_new {a.max_new}")
    print("| path | weights | batch | generated tokens | s | tok/s | vs engine | answers equal to the engine's |")
    print("|---|---|---|---|---|---|---|---|")
    e_rate = n_engine / t_engine
    print(f"| engine (LLM.generate), states not kept | float32 | {a.engine_batch} | {n_engine} | {t_engine:.1f} | "
          f"{e_rate:.1f} | 1.00x | - |")
    for q, n, sec, same, w in rows:
        how = "one pass with hidden states (selfgen)" + (f", {w} workers x 1 thread" if w > 1 else "")
        print(f"| {how} | { {'none': 'float32', 'bf16': 'bfloat16'}.get(q, q)} | {a.batch} | {n} | "
              f"{sec:.1f} | {n / sec:.1f} | {n / sec / e_rate:.2f}x | {same}/{len(prompts)} |")


def _load(model: str, q: str):
    """The target of one precision: bf16 = bfloat16 weights and activations (`datagen --dtype bf16`), else the
    quantization's."""
    return load_target(model, dtype=torch.bfloat16) if q == "bf16" else load_target(model, quantization=q)


def _work(args):
    """One worker: its share of the prompts on one thread -> (tokens, {prompt index: answer ids})."""
    model, q, prompts, idx, max_new, eos, layers, batch = args
    torch.set_num_threads(1)
    target = _load(model, q)
    got = {}
    res = generate_with_states(target, [prompts[i] for i in idx], max_new, eos, layers, batch=batch,
                               emit=lambda j, ids, m, h: got.__setitem__(idx[j], ids[len(prompts[idx[j]]):].tolist()))
    return res["tokens"], got


def _workers(a, q, prompts, eos, layers, outs):
    """(tokens, wall seconds, answers equal to the engine's) of a.workers processes splitting the prompts."""
    import multiprocessing as mp
    jobs = [(a.model, q, prompts, list(range(i, len(prompts), a.workers)), a.max_new, eos, layers,
             a.batch) for i in range(a.workers)]
    with mp.get_context("spawn").Pool(a.workers) as pool:
        t = time.perf_counter()
        res = pool.map(_work, jobs)
        sec = time.perf_counter() - t
    got = {k: v for _, g in res for k, v in g.items()}
    same = sum(got[i] == list(o.outputs[0].token_ids) for i, o in enumerate(outs))
    return sum(n for n, _ in res), sec, same

if __name__ == "__main__":
    main()
