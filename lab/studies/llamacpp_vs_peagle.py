"""peagle vs llama.cpp on the same GGUF file and thread count (issue 39): SmolLM2-135M-Instruct's packaged
Q4_1 file, the same prompt token ids, greedy, T new tokens each, decode tokens/s (prompt processing excluded on
both sides: prefill is timed apart). peagle runs the file's blocks as stored, with float32 activations
(`--quantization q4`) and with 8-bit activations like llama.cpp (`q4a8`, the default there), plain and with
P-EAGLE K=1; llama.cpp runs through its Python package, built from source into `.venv-llama` (not part of
`make setup` or `make test`; the study builds it when missing, which takes ~10-20 minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=ON" python -m venv .venv-llama && \\
        .venv-llama/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
    .venv/bin/python lab/studies/llamacpp_vs_peagle.py --prompts 8 --max-new 64 --threads 2

Rounds alternate the two engines (llama.cpp, peagle plain, peagle P-EAGLE) so machine drift hits all alike; the
report gives the median of rounds and the fraction of prompts whose tokens agree with peagle's plain output.

Long contexts: `--context N` gives every engine prompts of N tokens of peagle's own source instead of the dataset's
(llama.cpp's context sized to fit), and `--kv-f32` adds peagle q4a8 on a float32 KV cache (llama.cpp's cache is
float16 by default; peagle's bfloat16 under q4a8 unless told; before that default, `--kv-bf16` added the
bfloat16 rows):

    .venv/bin/python lab/studies/llamacpp_vs_peagle.py --prompts 2 --context 2048 --kv-f32 --no-q4 --threads 2"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LLAMA_PY = os.path.join(".venv-llama", "bin", "python")

# Runs inside .venv-llama: reads {"gguf", "prompts", "max_new", "threads"} on stdin, prints per prompt the new
# token ids and the decode seconds (after the prompt's evaluation), one JSON object.
LLAMA_CODE = r'''
import json, sys, time
from llama_cpp import Llama
a = json.load(sys.stdin)
m = Llama(model_path=a["gguf"], n_ctx=a["n_ctx"], n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False,
          logits_all=False)
out = []
for ids in a["prompts"]:
    m.reset()
    t0 = time.perf_counter()
    m.eval(ids)
    t1 = time.perf_counter()
    toks = []
    for _ in range(a["max_new"]):
        t = m.sample(temp=0.0, top_k=1)
        if t == m.token_eos():
            break
        toks.append(int(t))
        m.eval([t])
    out.append({"ids": toks, "prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1})
print(json.dumps(out))
'''


def run_llama(gguf: str, prompts: list, max_new: int, threads: int) -> list:
    n_ctx = max(1024, max(len(p) for p in prompts) + max_new + 8)
    p = subprocess.run([LLAMA_PY, "-c", LLAMA_CODE], input=json.dumps(
        {"gguf": gguf, "prompts": prompts, "max_new": max_new, "threads": threads, "n_ctx": n_ctx}),
        capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if p.returncode:
        raise SystemExit(f"llama.cpp run failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_peagle(llm, prompts: list, max_new: int, steps: bool = False) -> list:
    """Decode seconds per prompt: the whole generate minus a prefill-only generate (max_tokens=1) of it; with
    steps, the engine's steps after the one that prefilled (it also ran the first decode step), timed directly (at
    long contexts the prefill's own spread would swamp the difference), over the tokens those steps gave
    ("timed_tokens")."""
    from peagle.sampling import SamplingParams
    out = []
    for i, ids in enumerate(prompts):
        if steps:
            eng = llm.engine
            r = eng.add_request(f"study-{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0,
                                                                                        max_tokens=max_new))
            t0 = time.perf_counter()
            eng.step()                                  # admits and prefills it, then a first decode step
            t1, n1 = time.perf_counter(), len(r.output_ids)
            while eng.has_unfinished():
                eng.step()
            t2 = time.perf_counter()
            out.append({"ids": list(r.output_ids), "prefill_s": t1 - t0, "decode_s": t2 - t1,
                        "timed_tokens": len(r.output_ids) - n1})
            continue
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
        t1 = time.perf_counter()
        o = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_new))[0].outputs[0]
        t2 = time.perf_counter()
        out.append({"ids": list(o.token_ids), "prefill_s": t1 - t0, "decode_s": (t2 - t1) - (t1 - t0)})
    return out


def main(argv=None) -> int:
    import torch

    from lab.measure.precision import cpu_flags
    from peagle.data.benchmarks import encode_prompt, load_dataset
    from peagle.default_target import gguf_path
    from peagle.llm import DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD, LLM
    from peagle.spec_config import speculative_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--context", type=int, default=0,
                    help="prompts of this many tokens of peagle's own source instead of the dataset's (0: the dataset)")
    ap.add_argument("--kv-f32", action="store_true",
                    help="add peagle q4a8 on a float32 KV cache (its default under q4a8: bfloat16)")
    ap.add_argument("--no-q4", action="store_true", help="leave out peagle q4 (float activations: slow prefill)")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    a = ap.parse_args(argv)
    if not os.path.isfile(LLAMA_PY):
        raise SystemExit(f"no {LLAMA_PY}: build llama.cpp's Python package first (see this file's docstring)")
    torch.set_num_threads(a.threads)
    gguf = gguf_path()
    base = LLM(DEFAULT_MODEL, quantization="q4a8", max_num_seqs=1)
    spec = base.with_speculative_config(speculative_config(DEFAULT_PEAGLE_HEAD, 1, True))
    tok = base.get_tokenizer()
    if a.context:
        from lab.measure.kv_cache import source_ids
        src = source_ids(tok)
        if len(src) < a.prompts * a.context:
            raise SystemExit(f"peagle's source is {len(src)} tokens, short of {a.prompts} x {a.context}")
        prompts = [src[i * a.context:(i + 1) * a.context] for i in range(a.prompts)]
    else:
        prompts = [encode_prompt(tok, base.engine.target.cfg.vocab_size, p) for p in load_dataset(a.dataset, a.prompts)]
        prompts = [p[-512:] for p in prompts]
    engines = {} if a.no_q4 else {"peagle q4, plain": LLM(DEFAULT_MODEL, quantization="q4", max_num_seqs=1)}
    engines |= {"peagle q4a8, plain": base, "peagle q4a8, P-EAGLE K=1": spec}
    if a.kv_f32:
        f32 = LLM(DEFAULT_MODEL, quantization="q4a8", max_num_seqs=1, kv_cache_dtype="float32")
        engines |= {"peagle q4a8 f32 KV, plain": f32,
                    "peagle q4a8 f32 KV, P-EAGLE K=1": f32.with_speculative_config(
                        speculative_config(DEFAULT_PEAGLE_HEAD, 1, True))}
    runs = {"llama.cpp (Q4_1 file)": [], **{name: [] for name in engines}}
    outs = {}
    for _ in range(a.rounds):
        for name in runs:
            res = run_llama(gguf, prompts, a.max_new, a.threads) if name.startswith("llama") else \
                run_peagle(engines[name], prompts, a.max_new, steps=bool(a.context))
            n = sum(r.get("timed_tokens", len(r["ids"])) for r in res)
            runs[name].append(n / sum(r["decode_s"] for r in res))
            outs[name] = res
    refs = [outs["peagle q4a8, plain"]] if a.no_q4 else [outs["peagle q4, plain"], outs["peagle q4a8, plain"]]
    what = (f"{len(prompts)} prompts of {a.context} tokens of peagle's source" if a.context
            else f"{len(prompts)} {a.dataset} prompts")
    ref_names = "q4a8" if a.no_q4 else "q4 / q4a8"
    lines = [f"CPU: {cpu_flags()}; {a.threads} threads; {what}, {a.max_new} new tokens, "
             f"greedy; decode tokens/s, median of {a.rounds} alternating rounds", "",
             f"| engine | decode tok/s | vs llama.cpp | prompts with tokens equal to peagle {ref_names} plain's | mean "
             "common prefix with them (tokens) |", "|---|---|---|---|---|"]
    base_rate = statistics.median(runs["llama.cpp (Q4_1 file)"])
    for name, rates in runs.items():
        same = [sum(o["ids"] == r["ids"] for o, r in zip(outs[name], ref)) for ref in refs]
        prefix = [statistics.mean(next((i for i, (x, y) in enumerate(zip(o["ids"], r["ids"])) if x != y),
                                       min(len(o["ids"]), len(r["ids"]))) for o, r in zip(outs[name], ref))
                  for ref in refs]
        lines.append(f"| {name} | {statistics.median(rates):.1f} | {statistics.median(rates) / base_rate:.2f}x | "
                     f"{' / '.join(map(str, same))} of {len(prompts)} | {' / '.join(f'{x:.1f}' for x in prefix)} |")
    extra = (f" --context {a.context}" if a.context else "") + (" --kv-f32" if a.kv_f32 else "") + \
        (" --no-q4" if a.no_q4 else "")
    lines += ["", f"Regenerate: `.venv/bin/python lab/studies/llamacpp_vs_peagle.py --prompts {a.prompts} --max-new "
              f"{a.max_new} --threads {a.threads} --rounds {a.rounds}{extra}`"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
