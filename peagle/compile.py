"""Optional torch.compile of the step's forward passes (`--compile`, `LLM(..., compile=True)`).

Off by default: measured on this 2-core CPU it loses (plain decoding 0.66x eager in steady state after 39 s of
compilation, docs/benchmarks/compile.md, `lab/measure/compile_speed.py`), and it has not been measured on a GPU. When on,
the target's forward and the drafter's cached forward are compiled with dynamic shapes (batch, block and
attention span vary every step), and the engine drops its host-side fast paths (one-slice writes and
maskless single-token attention, keyed on Python ints that would otherwise force recompilation) and rounds
attention spans up to a multiple of SPAN_BUCKET, so a handful of graphs serve a whole run. Outputs are the same
computation; greedy outputs stay identical to plain decoding (tests/test_compile.py, marked slow).
CUDA graphs are not used: they need fixed shapes and cache addresses (bucketed batch sizes and spans)."""
from __future__ import annotations

import torch

SPAN_BUCKET = 64


def compile_forward(obj, name: str, mode: str | None = None):
    """Replace obj.<name> by its compiled version once (a target shared by several engines is compiled once)."""
    if getattr(obj, f"_compiled_{name}", False):
        return
    setattr(obj, name, torch.compile(getattr(obj, name), dynamic=True, mode=mode))
    setattr(obj, f"_compiled_{name}", True)


def compile_step(target, proposer=None, mode: str | None = None):
    compile_forward(target, "forward", mode)
    head = getattr(proposer, "head", None)
    if head is not None and hasattr(head, "_forward_cached"):
        compile_forward(head, "_forward_cached", mode)


def bucket(span: int) -> int:
    return -(-span // SPAN_BUCKET) * SPAN_BUCKET


def add_argument(p):
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's and drafter's forward passes (off by default: see peagle/compile.py)")
