"""MKL's vector math starts on one thread, so torch's exp / cos / sin / log of a large CPU tensor give the same
bits in every process.

Invariant: after `import peagle`, a process's first large call of torch's MKL-backed element-wise math (ATen's
vml.h: exp, log, cos, sin, tanh, sqrt ... in float32 and float64) gives the bits of its later calls, whatever the
thread count.

Why: on a 2-core Intel Xeon VM (AVX-512, AMX; torch 2.13 with MKL 2024.2) the process's first such call, split
by at::parallel_for over 2 threads after an MKL matrix product, returned less exact values for one thread's share
in some fresh processes; later calls were exact. peagle's first such call was the target's RoPE cos table, so
greedy output differed between processes (never on one thread). A call on a few values runs on the calling
thread alone (below ATen's grain) and takes MKL's first call. Measured: docs/benchmarks/vml-first-call.md.
"""
from __future__ import annotations

import torch


def warm() -> None:
    """MKL's first vector-math call, on this thread alone (a few values: below ATen's parallel grain)."""
    torch.ones(8, dtype=torch.float64).exp()


warm()   # once per process: the module's import
