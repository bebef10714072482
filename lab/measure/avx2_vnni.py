"""The AVX2 path's 8-bit-activation products with dpbusd on ymm (quant_a8_vnni256.cpp, the default where the CPU
has AVX-512 VNNI) against the same path with maddubs + madd (quant_a8_avx2.cpp, what it ran before), side by side
in one process on one target: each setting with its own AVX2 / AVX-512 thresholds, timed for it here as a load
times them (peagle/models/kernel_choice.py), then interleaved round by round: target forwards of T = 1..9 tokens
on a cache of --context positions (min of the rounds, each after --warm untimed forwards of the same shape), and
greedy decoding through the engine, plain and speculative (median tokens/s of the rounds; the tokens must be the
same in both settings: the same integers, so the same bits).

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/avx2_vnni.py --out docs/benchmarks/avx2-vnni.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report
from peagle import LLM, SamplingParams
from peagle.default_target import TARGET_DIR
from peagle.models import kernel_choice, quant_ext

HEAD = "models/smollm2-135m-instruct-peagle"
PROMPTS = ["def fibonacci(n):", "Explain the difference between a list and a tuple in Python.",
           "Write a haiku about the sea.", "import numpy as np\n\ndef normalize(x):"]
SETTINGS = {"dpbusd on ymm": True, "maddubs (before)": False}


def spec_configs(spec: str) -> dict:
    """'plain,1,3,tree4x4:1' -> {name: speculative config or None} (P-EAGLE, the shipped head)."""
    out = {}
    for item in spec.split(","):
        if item == "plain":
            out[item] = None
            continue
        tree, _, k = item.rpartition(":") if ":" in item else ("", "", item)
        cfg = {"method": "eagle3", "parallel_drafting": True, "model": HEAD, "num_speculative_tokens": int(k)}
        if tree:
            topk, nodes = tree.removeprefix("tree").split("x")
            cfg.update(eagle_topk=int(topk), num_draft_tokens=int(nodes))
        out[f"P-EAGLE K={k}" + (f" {tree}" if tree else "")] = cfg
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TARGET_DIR)
    ap.add_argument("--quantization", default="q4a8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--blocks", default="1,2,3,4,5,6,7,8,9", help="tokens per forward (1: the plain step, first)")
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--decode", default="plain,1,3,tree4x4:1",
                    help="engine runs: plain, P-EAGLE chains of K, P-EAGLE trees treeTOPKxNODES:K")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    ext = quant_ext.get()
    if ext is None or not ext.has_avx512():
        print("nothing to compare: the dpbusd form needs the built kernels on a CPU with AVX-512 VNNI", file=sys.stderr)
        return 2
    base = LLM(model=a.model, quantization=a.quantization)
    target = base.engine.target
    alone: dict = {}                             # {setting: {kind: {rows: [AVX2 ms, AVX-512 ms]}}}, min of passes
    for name in [*SETTINGS, *reversed(SETTINGS)]:   # each setting timed twice, A B B A, as a load times them
        ext.set_avx2_vnni(SETTINGS[name])
        got = kernel_choice.measure(ext, target._projections())[1]
        prev = alone.setdefault(name, got)
        for kind, by_rows in got.items():
            for m, cell in by_rows.items():
                prev[kind][m] = [min(x, y) for x, y in zip(prev[kind][m], cell)]
    paths = {name: {kind: kernel_choice.choose({(m, p): t for m, c in by_rows.items() for p, t in zip(("avx2", "avx512"), c)})
                    for kind, by_rows in alone[name].items()} for name in SETTINGS}
    llms = {n: (base if cfg is None else base.with_speculative_config(cfg)) for n, cfg in spec_configs(a.decode).items()}
    blocks = sorted({1} | {int(b) for b in a.blocks.split(",")})   # T=1: the ratios' base
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache(1, a.context + max(blocks) + 8)
    target.forward(torch.randint(20, 40000, (1, a.context), generator=gen), cache, 0, torch.zeros(1, dtype=torch.long))
    start = torch.full((1,), a.context)
    fwd = {(s, T): [] for s in SETTINGS for T in blocks}
    rates = {(s, n): [] for s in SETTINGS for n in llms}
    toks: dict = {}
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    for rnd in range(a.rounds):
        for s in (SETTINGS if rnd % 2 == 0 else list(SETTINGS)[::-1]):
            ext.set_avx2_vnni(SETTINGS[s])
            target.kernel_paths = paths[s]          # the target sets them before each forward
            for T in blocks:
                x = torch.randint(20, 40000, (1, T), generator=gen)
                for _ in range(a.warm):
                    target.forward(x, cache, 0, start, span=a.context + T, s0=a.context)
                t0 = time.perf_counter()
                target.forward(x, cache, 0, start, span=a.context + T, s0=a.context)
                fwd[s, T].append(time.perf_counter() - t0)
            for n, llm in llms.items():
                t0, count = time.perf_counter(), 0
                for p in PROMPTS:
                    ids = llm.generate([p], sp)[0].outputs[0].token_ids
                    count += len(ids)
                    toks.setdefault((s, n), []).append(list(ids))
                rates[s, n].append(count / (time.perf_counter() - t0))
    ext.set_avx2_vnni(True)
    new, old = SETTINGS
    ref = toks[new, "plain" if "plain" in llms else next(iter(llms))]
    same = all(v == ref for v in toks.values())
    ms = {k: min(v) * 1e3 for k, v in fwd.items()}
    lines = [f"# The AVX2 path's 8-bit products: dpbusd on ymm vs maddubs ({a.quantization})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; kernels: "
             f"{quant_ext.describe()}.", "",
             f"Thresholds timed here (AVX2 path below that many rows): {new}: {json.dumps(paths[new])}; "
             f"{old}: {json.dumps(paths[old])}.", "",
             "Every product of a step alone, per kind (ms; kernel_choice.measure, each kind inside whole steps, "
             "twice per setting in the order A B B A, min; the AVX-512 path as timed in the first setting's):", "",
             "| kind | rows | " + " | ".join(f"AVX2 path, {s}" for s in SETTINGS) + " | AVX-512 path | "
             f"{new} ÷ {old} |", "|---|---|---|---|---|---|"]
    for kind, by_rows in alone[new].items():
        for m, (avx2_ms, avx512_ms) in by_rows.items():
            if m <= max(blocks):
                o = alone[old][kind][m][0]
                lines.append(f"| {kind} | {m} | {avx2_ms:.2f} | {o:.2f} | {avx512_ms:.2f} | {avx2_ms / o:.2f} |")
    lines += ["", f"Target forward of T tokens after {a.context} cached positions (ms, min of {a.rounds} interleaved "
             f"rounds, each after {a.warm} untimed):", "",
             "| setting | " + " | ".join(f"T={T}" for T in blocks) + " | " +
             " | ".join(f"T={T} / T=1" for T in blocks if T > 1) + " |",
             "|---|" + "---|" * (2 * len(blocks) - 1)]
    for s in SETTINGS:
        lines.append(f"| {s} | " + " | ".join(f"{ms[s, T]:.2f}" for T in blocks) + " | " +
                     " | ".join(f"{ms[s, T] / ms[s, 1]:.2f}x" for T in blocks if T > 1) + " |")
    lines.append(f"| {new} ÷ {old} (time) | " + " | ".join(f"{ms[new, T] / ms[old, T]:.2f}" for T in blocks) +
                 " |" + " |" * (len(blocks) - 1))
    lines += ["", f"Greedy decoding through the engine, {len(PROMPTS)} prompts x {a.max_tokens} tokens one after "
              f"another (tokens/s, median of {a.rounds} interleaved rounds; P-EAGLE: the shipped head):", "",
              f"| run | {new} | {old} | ratio |", "|---|---|---|---|"]
    for n in llms:
        r_new, r_old = statistics.median(rates[new, n]), statistics.median(rates[old, n])
        lines.append(f"| {n} | {r_new:.1f} | {r_old:.1f} | **{r_new / r_old:.2f}x** |")
    lines += ["", f"Tokens identical in both settings and in every run{' (speculative = plain)' if 'plain' in llms else ''}: "
              f"{same}."]
    write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/avx2_vnni.py", argv, a.out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
