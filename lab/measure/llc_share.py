"""What a drafter's reads cost the target's next step: the target's weights against this machine's last-level
cache (issue 39 / 40: why a speculative step costs more than its parts measured alone).

Three tables, one process:
1. read bandwidth by buffer size (a buffer read again and again: the size where it falls is the share of the
   last-level cache this process gets; on a VM far less than lscpu's L3);
2. the bytes one pass reads: the target's projections and each head's (as the engine prepares it for this
   target's quantization);
3. the target's plain step (1 token, --context cached positions) when X MB of other memory is read between
   steps, X = --other: blocks of --block steps per size, --cycles times round robin, median per size.
A drafter pass between two target steps reads its own weights; where the target's weights only just fit in
what the cache gives this process, every MB of them displaces target weights the next step re-reads from
memory.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/llc_share.py --out docs/benchmarks/llc-share.md

Quick check that it runs (numbers meaningless): --sizes 2,8 --other 0,4 --block 3 --cycles 1 --context 16.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.cpu_step import projection_bytes, weight_bytes
from lab.measure.precision import bandwidth_gbs, cpu_flags, write_report
from peagle.default_target import TARGET_DIR
from peagle.heads.model import DrafterHead
from peagle.models import quant_ext
from peagle.models.llama import Transformer


def head_bytes(head: DrafterHead) -> int:
    """Bytes of the projections one drafter pass reads (fused layers, fc, draft LM head) as prepared."""
    return projection_bytes([w for f in head._fused for w in f] + [head._fc_t, head._lm_head_t])


def step_after_reads(t: Transformer, context: int, other_mb: list[int], block: int, cycles: int) -> dict:
    """Median plain-step ms of `t` per size of other memory read before each step (see the module doc)."""
    gen = torch.Generator().manual_seed(0)
    cache = t.new_cache(1, context + 8)
    t.forward(torch.randint(20, 40000, (1, context), generator=gen), cache, 0, torch.zeros(1, dtype=torch.long))
    start = torch.full((1,), context)
    bufs = {mb: torch.ones(mb * 2**20 // 4) for mb in other_mb}
    times: dict[int, list[float]] = {mb: [] for mb in other_mb}
    for _ in range(cycles):
        for mb, buf in bufs.items():
            for i in range(block + 2):
                if mb:
                    buf.sum()
                toks = torch.randint(20, 40000, (1, 1), generator=gen)
                t0 = time.perf_counter()
                t.forward(toks, cache, 0, start, span=context + 1, s0=context)
                if i >= 2:                      # the first steps of a block settle into its state
                    times[mb].append(time.perf_counter() - t0)
    return {mb: sorted(v)[len(v) // 2] * 1e3 for mb, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TARGET_DIR))
    ap.add_argument("--quantization", default="q4a8")
    ap.add_argument("--heads", default="models/smollm2-135m-instruct-eagle3,models/smollm2-135m-instruct-peagle")
    ap.add_argument("--sizes", default="2,8,16,32,64,96,128,192,256,512", help="buffer MB for table 1")
    ap.add_argument("--other", default="0,4,8,16,32", help="MB read between target steps for table 3")
    ap.add_argument("--block", type=int, default=80)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
        other = [int(s) for s in a.other.split(",")]
    except ValueError:
        ap.error("--sizes and --other take comma-separated whole MB")
    if min(sizes + other) < 0 or a.block < 1 or a.cycles < 1:
        ap.error("sizes must be >= 0, --block and --cycles >= 1")
    t = Transformer.from_pretrained(a.model, quantization=a.quantization)
    heads = {}
    for path in filter(None, a.heads.split(",")):
        h = DrafterHead.from_pretrained(path, t.cfg, dtype=t.dtype, target_embed=t.embed)
        heads[os.path.basename(path.rstrip("/"))] = head_bytes(h.prepare_inference(False, a.quantization))
    bw = {mb: max(bandwidth_gbs(mb, max(3, 1000 // mb)) for _ in range(2)) for mb in sizes if mb}
    step = step_after_reads(t, a.context, other, a.block, a.cycles)
    tb = weight_bytes(t)
    lines = [f"# A drafter's reads against the target's weights in the last-level cache "
             f"({os.path.basename(a.model.rstrip('/'))}, {a.quantization})", "",
             f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; kernels: "
             f"{quant_ext.describe()}.", "",
             "Read bandwidth of a buffer read again and again (best of 2 x repeated reads):", "",
             "| buffer (MB) | " + " | ".join(str(mb) for mb in bw) + " |",
             "|---|" + "---|" * len(bw),
             "| GB/s | " + " | ".join(f"{g:.1f}" for g in bw.values()) + " |", "",
             "Bytes one pass reads (projections, as prepared for this target):", "",
             "| pass | MB |", "|---|---|", f"| target step | {tb / 2**20:.1f} |"]
    lines += [f"| drafter {name} | {b / 2**20:.1f} |" for name, b in heads.items()]
    base = step.get(0)
    lines += ["", f"The target's plain step (context {a.context}) after reading X MB of other memory before each "
              f"step (median of {a.block} x {a.cycles} steps per X, blocks round robin):", "",
              "| other MB | step (ms) | vs none | added per other MB |", "|---|---|---|---|"]
    for mb, ms in step.items():
        rel = f"{ms / base:.2f}x" if base else "-"
        per = f"{(ms - base) / mb * 1e3:.0f} us" if base and mb else "-"
        lines.append(f"| {mb} | {ms:.3f} | {rel} | {per} |")
    return write_report(lines, "OMP_NUM_THREADS=2 .venv/bin/python lab/measure/llc_share.py", argv, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
