"""Target step cost by precision and weight layout: one plain decode step (1 token) vs verifying K+1 tokens, for
--batch requests at once, on a cache already holding --context positions, plus this machine's memory-read
bandwidth and the time one read of the weights takes (the bound a weight-bound plain step approaches).

Every configuration and block size is interleaved in each round; the minimum over --rounds is reported (the
machine's other load only ever adds time). Layouts: "io" = x @ W[in,out] for every product; "dual" = also
W[out,in] @ x^T for products of several rows; "packed" = oneDNN's packed weights for those instead
(peagle.models.layers.Weight; the default where it measures faster). These are torch's products: float32 targets run
here with llama.F32_KERNEL off (on the CPU, peagle's own F32 kernel is the default since 2026-12-03; it is
measured against these in lab/measure/cpu_step.py --torch-f32).

    .venv/bin/python lab/measure/precision.py --out docs/benchmarks/precision.md
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import shlex
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from peagle.default_target import TARGET_DIR
from peagle.models import llama
from peagle.models.layers import Weight
from peagle.models.llama import Transformer
from peagle.paths import portable_path


def bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def cpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(simd) or 'no AVX2'})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TARGET_DIR)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--blocks", default="1,2,4,6,8")
    ap.add_argument("--batch", type=int, default=1, help="requests per forward (each a block of T tokens)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    blocks = [int(b) for b in a.blocks.split(",")]
    configs = {}
    llama.F32_KERNEL = False              # torch's products and layouts are what this study compares
    for dt in a.dtypes.split(","):
        t = Transformer.from_pretrained(a.model, getattr(torch, dt))
        if t.dual_layout:
            configs[(dt, "packed" if t.lm_head_t.pk is not None else "dual")] = t
            if t.lm_head_t.pk is not None:
                configs[(dt, "dual")] = io_twin(t, oi=True)
        configs[(dt, "io")] = io_twin(t)
    caches, gen = {}, torch.Generator().manual_seed(0)
    B = a.batch
    V = min(40000, next(iter(configs.values())).cfg.vocab_size)      # token ids the model has
    ctx_toks = torch.randint(20, V, (B, a.context), generator=gen)
    for key, t in configs.items():
        c = t.new_cache(B, a.context + max(blocks) + 8)
        t.forward(ctx_toks, c, 0, torch.zeros(B, dtype=torch.long))
        caches[key] = c
    start = torch.full((B,), a.context)
    times = {(key, T): [] for key in configs for T in blocks}
    for _ in range(a.rounds):
        for key, t in configs.items():
            for T in blocks:
                toks = torch.randint(20, V, (B, T), generator=gen)
                times[(key, T)].append(_timed(lambda: t.forward(toks, caches[key], 0, start,
                                                                span=a.context + T, s0=a.context)))
    bw = bandwidth_gbs()
    weight_bytes = {dt: sum(v.numel() * v.element_size() for v in _weights(configs[(dt, "io")]))
                    for dt in {k[0] for k in configs}}
    best_plain = min(min(times[(key, 1)]) for key in configs)
    lines = [f"# Target step cost by precision and layout ({os.path.basename(a.model.rstrip('/'))})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; context "
             f"{a.context}; {B} request(s) per forward, each a block of T tokens; min of {a.rounds} interleaved rounds.", "",
             f"Memory read bandwidth (torch sum over 512 MB): **{bw:.1f} GB/s**.", ""]
    for dt, nb in sorted(weight_bytes.items()):
        lines.append(f"- {dt}: weights {nb / 1e6:.0f} MB, one read {nb / bw / 1e6:.1f} ms")
    lines += ["", "| dtype | layout | " + " | ".join(f"{T} tok (ms)" for T in blocks) + " | verify 8 / plain | "
              "plain vs fastest plain |", "|---|---|" + "---|" * (len(blocks) + 2)]
    for key in configs:
        ms = {T: min(times[(key, T)]) * 1e3 for T in blocks}
        ratio = f"{ms[8] / ms[1]:.2f}x" if 8 in ms else "-"
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(f"{ms[T]:.1f}" for T in blocks) +
                     f" | {ratio} | {min(times[(key, 1)]) / best_plain:.2f}x |")
    return write_report(lines, ".venv/bin/python lab/measure/precision.py", argv, a.out)


def write_report(lines: list[str], command: str, argv, out: str | None) -> int:
    """Print a report (its last line: the command that regenerates it, flags as given, paths made portable) and
    write it to `out` when given."""
    lines = lines + ["", f"Regenerate: `{command} " +
                     " ".join(shlex.quote(x if not os.path.isabs(x) else portable_path(x))
                              for x in (argv or sys.argv[1:])) + "`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return 0


def io_twin(t: Transformer, oi: bool = False) -> Transformer:
    """The same target sharing its io tensors, with every product through x @ W_io (no second copy), or with
    oi: few-row products through W_oi @ x^T (dense [out, in] copies, not oneDNN's packed weights)."""
    def single(w):
        v = Weight(w.io.t(), False, io=w.io)
        if oi:
            v.oi = w.io.t().contiguous()
        return v
    twin = copy.copy(t)
    twin.lm_head_t = single(t.lm_head_t)
    twin.layers = []
    for L in t.layers:
        L2 = copy.copy(L)
        for n in ("qkv_w", "o_w", "gate_up", "down"):
            setattr(L2, n, single(getattr(L, n)))
        twin.layers.append(L2)
    return twin


def _weights(t):
    yield t.embed
    for L in t.layers:
        for n in ("qkv_w", "o_w", "gate_up", "down"):
            yield getattr(L, n).io


if __name__ == "__main__":
    sys.exit(main())
