"""Two builds of the C++ kernels side by side in one process: a git revision's peagle/csrc against this checkout's
build, alternated round by round, every output compared bit for bit.

The revision's sources (`git archive`) are built under another module name (build/kernel-ab/<rev>/, once per
revision), so both extensions load into one process and run on the same machine state: each product of a target's
step (its 8-bit-activation or weight-only kinds, at --rows rows, on one thread and on the run's threads) and whole
target steps (plain and verify(T): the layer runner, on a cache holding --context positions). The two builds'
outputs must be identical (a kernel change that moves a bit is not a speed change; the script stops).

Where a target's weights lie in memory moves its speed: on a 2-core Intel Xeon VM the same build's target loaded
second ran its forwards 3-8 % faster than the one loaded first, so one copy per build, loaded in a fixed order,
favoured whichever build came second (a build against itself read 0.92-0.97x one way round, 1.04-1.09x the
other). So each build gets --instances copies of its weights (targets, and the products' packed blocks), loaded
in the order base, this, this, base, base, this, ... (every build as often early as late); each round times every
copy, in an order that rotates; a build's figure pools all its copies' rounds (min, median), and the report gives
the spread between a build's own copies: a difference between the builds within that spread is placement, not
code. Run a revision against itself (--base HEAD with a clean peagle/csrc) to see the floor on a machine.

    OMP_NUM_THREADS=2 .venv/bin/python lab/measure/kernel_ab.py --base HEAD~1 --out /tmp/kernel-ab.md
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from statistics import median_high

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.precision import cpu_flags, write_report
from lab.measure.serve_speed import checkout_name
from peagle.default_target import TARGET_DIR
from peagle.device import cpuinfo
from peagle.errors import PeagleError
from peagle.models import quant as Q
from peagle.models import quant_ext
from peagle.models.llama import Transformer
from peagle.paths import HOME


def cpu_model() -> str:
    """lscpu's name and SIMD flags with /proc/cpuinfo's family / model (a VM may name every EPYC alike)."""
    return f"{cpu_flags()}, family {cpuinfo('cpu family') or '?'} model {cpuinfo('model') or '?'}"


def build_base(rev: str):
    """The extension of `rev`'s peagle/csrc, built with `rev`'s own source list and flags, as module pq_<sha>."""
    try:
        sha = subprocess.run(["git", "rev-parse", rev], cwd=HOME, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise PeagleError(f"--base {rev}: not a git revision of this checkout") from e
    name, out = f"pq_{sha[:12]}", os.path.join(HOME, "build", "kernel-ab", sha[:12])
    so = os.path.join(out, name + ".so")
    if not os.path.isfile(so):
        with tempfile.TemporaryDirectory() as tmp:
            tar = os.path.join(tmp, "src.tar")
            subprocess.run(["git", "archive", "-o", tar, sha, "peagle/csrc", "peagle/models/quant_ext.py"], cwd=HOME,
                           check=True)
            with tarfile.open(tar) as t:
                t.extractall(tmp, filter="data")
            # its constants only (SOURCES, CFLAGS, LDFLAGS): the module's relative import is not run
            path = os.path.join(tmp, "peagle/models/quant_ext.py")
            with open(path) as f:
                text = f.read().replace("from ..paths import HOME, SETUP_COMMAND", "HOME = SETUP_COMMAND = ''")
            consts: dict = {"__name__": "base_quant_ext", "__file__": path}
            exec(compile(text, path, "exec"), consts)
            from torch.utils.cpp_extension import load
            os.makedirs(out, exist_ok=True)
            print(f"building {rev} ({sha[:12]}) into {out} ...", file=sys.stderr)
            load(name=name, sources=[os.path.join(tmp, "peagle/csrc", f) for f in consts["SOURCES"]],
                 extra_cflags=list(consts["CFLAGS"]), extra_ldflags=list(consts["LDFLAGS"]), build_directory=out)
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, sha


@contextlib.contextmanager
def using(mod):
    """Every quant_ext.get() inside returns `mod` (a target's Python-side products, the LM head among them)."""
    saved = quant_ext._mod, quant_ext._tried
    quant_ext._mod, quant_ext._tried = mod, True
    try:
        yield
    finally:
        quant_ext._mod, quant_ext._tried = saved


def placement_order(builds: list, instances: int) -> list:
    """(build, copy) in load order: base, this, this, base, base, this, ... -- every build as often early as late."""
    order = []
    for i in range(instances):
        order += [(n, i) for n in (builds if i % 2 == 0 else builds[::-1])]
    return order


def rotated(seq: list, r: int) -> list:
    """seq rotated by r (each round starts at another copy)."""
    r %= len(seq)
    return seq[r:] + seq[:r]


def takes_packed(e) -> bool:
    """Whether a build's float-activation product takes pack_a8's layout (its AVX-512 path reads it since
    quant_f_avx512.cpp; an older build's has no such argument)."""
    return "packed:" in (e.qlinear.__doc__ or "")


def products(exts: dict, weights, rows, rounds: int, threads: int, instances: int) -> dict:
    """{(M, (name, copy)): [seconds]} for one pass over every product of a step at M rows, per round: each
    build's copies of the weights (the GGUF blocks and their packed form) made in placement_order."""
    gen = torch.Generator().manual_seed(0)
    xs = {m: {k: torch.randn(m, k, generator=gen) for k in {w.k for w in weights}} for m in rows}
    copies = {}
    for n, i in placement_order(list(exts), instances):
        e = exts[n]
        data = [w.data.clone() for w in weights]
        copies[n, i] = [(d, e.pack_a8(d, w.qtype, w.n, w.k) if w.act8 or (takes_packed(e) and w.qtype != Q.F32)
                         else None) for w, d in zip(weights, data)]

    def run(key, m):
        e = exts[key[0]]
        return [e.qlinear_a8(xs[m][w.k], d, p, w.qtype, w.n, w.k, 0) if w.act8
                else e.qlinear(xs[m][w.k], d, w.qtype, w.n, w.k, 0, *([p] if p is not None else []))
                for w, (d, p) in zip(weights, copies[key])]
    times: dict = {}
    torch.set_num_threads(threads)
    for m in rows:
        ys = {n: run((n, 0), m) for n in exts}
        a, b = ys.values()
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            raise PeagleError(f"the builds' products differ at {m} rows: not a speed change")
        for r in range(rounds):
            for key in rotated(list(copies), r):
                run(key, m)                                   # untimed: the weights as a step leaves them
                t0 = time.perf_counter()
                run(key, m)
                dt = time.perf_counter() - t0
                times.setdefault((m, key), []).append(dt)
    return times


def steps(exts: dict, model: str, quantization: str, blocks, ctx: int, rounds: int, instances: int) -> tuple:
    """({(T, (name, copy)): [seconds]} of whole target forwards of T tokens, each
    build's own targets loaded in placement_order, every copy every round in a rotating order; what the target
    runs, as it says at load)."""
    gen = torch.Generator().manual_seed(0)
    toks0 = torch.randint(20, 40000, (1, ctx), generator=gen)
    tg, caches = {}, {}
    for key in placement_order(list(exts), instances):
        with using(exts[key[0]]):
            tg[key] = Transformer.from_pretrained(model, quantization=quantization)
            caches[key] = tg[key].new_cache(1, ctx + max(blocks) + 8)
            tg[key].forward(toks0, caches[key], 0, torch.zeros(1, dtype=torch.long))
    start, times = torch.full((1,), ctx), {}
    for r in range(rounds):
        for T in blocks:
            toks, out = torch.randint(20, 40000, (1, T), generator=gen), {}
            for key in rotated(list(tg), r):
                with using(exts[key[0]]):
                    tg[key].forward(toks, caches[key], 0, start, span=ctx + T, s0=ctx)
                    t0 = time.perf_counter()
                    y = tg[key].forward(toks, caches[key], 0, start, span=ctx + T, s0=ctx)
                    dt = time.perf_counter() - t0
                times.setdefault((T, key), []).append(dt)
                out[key] = y[0] if isinstance(y, tuple) else y
            first = next(iter(out.values()))
            if not all(torch.equal(first, y) for y in out.values()):
                raise PeagleError(f"the builds' targets differ on a {T}-token forward: not a speed change")
    return times, tg[next(iter(tg))].precision


def pooled(times: dict, shape, name: str, instances: int) -> list:
    """All of a build's copies' seconds at one shape."""
    return [t for i in range(instances) for t in times[shape, (name, i)]]


def spread(times: dict, shape, name: str, instances: int) -> str:
    """The slowest of a build's copies over its fastest, by median: what placement alone moves."""
    meds = [median_high(times[shape, (name, i)]) for i in range(instances)]
    return f"{max(meds) / min(meds):.2f}x"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision whose kernels this checkout's are timed against")
    ap.add_argument("--model", default=TARGET_DIR)
    ap.add_argument("--quantization", default="q4a8")
    ap.add_argument("--rows", default="1,2,3,4,8", help="rows per product")
    ap.add_argument("--blocks", default="1,2,4,8",
                    help="tokens per target forward (1: the plain step); '' times the products only (a base build "
                         "whose layer runner takes other arguments)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--instances", type=int, default=2,
                    help="copies of each build's weights, loaded base, this, this, base, ... (placement moves speed)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.instances < 1:
        ap.error("--instances must be at least 1")
    new = quant_ext.get()
    if new is None:
        print(f"needs this checkout's C++ kernels ({quant_ext.describe()})", file=sys.stderr)
        return 2
    try:
        base, sha = build_base(a.base)
        threads = torch.get_num_threads()
        exts = {"base": base, "this": new}
        rows, blocks = [int(r) for r in a.rows.split(",")], [int(b) for b in a.blocks.split(",") if b]
        with using(new):
            t = Transformer.from_pretrained(a.model, quantization=a.quantization)
            weights, precision = step_products(t), t.precision
        prod = {t: products(exts, weights, rows, a.rounds, t, a.instances) for t in sorted({1, threads})}
        torch.set_num_threads(threads)
        if blocks:
            st, precision = steps(exts, a.model, a.quantization, blocks, a.context, a.rounds, a.instances)
    except PeagleError as e:
        print(f"kernel_ab: {e}", file=sys.stderr)
        return 1
    mb = sum(w.nbytes for w in weights) / 1e6
    k = a.instances
    lines = [f"# Two kernel builds side by side ({os.path.basename(a.model.rstrip('/'))}, {a.quantization})", "",
             f"CPU: {cpu_model()}; torch {torch.__version__}; base: {a.base} ({sha[:10]}); this: "
             f"{checkout_name(HOME, ('peagle/csrc',))}; {precision}.", "",
             f"Every output of the two builds identical (products at {a.rows} rows"
             + (f", forwards of {a.blocks} tokens); " if blocks else "); ") +
             f"{k} copies of each build's weights, loaded {', '.join(n for n, _ in placement_order(list(exts), k))}; "
             f"{a.rounds} rounds, every copy timed in each, in an order rotating by round; min and median pool a "
             "build's copies; spread: a build's slowest copy over its fastest (median), what placement alone "
             "moves.", "",
             f"Every product of a step ({len(weights)} products, {mb:.1f} MB of weights; each pass after an untimed "
             "one, so what the machine's last-level cache keeps of them stays):", "",
             "| threads | rows | base min (ms) | this min (ms) | this ÷ base (min) | this ÷ base (median) | "
             "spread base / this |", "|---|---|---|---|---|---|---|"]
    for t, tm in prod.items():
        for m in rows:
            b, n = pooled(tm, m, "base", k), pooled(tm, m, "this", k)
            lines.append(f"| {t} | {m} | {min(b) * 1e3:.2f} | {min(n) * 1e3:.2f} | {min(n) / min(b):.2f}x | "
                         f"{median_high(n) / median_high(b):.2f}x | {spread(tm, m, 'base', k)} / "
                         f"{spread(tm, m, 'this', k)} |")
    if not blocks:
        return write_report(lines, f"OMP_NUM_THREADS={threads} .venv/bin/python lab/measure/kernel_ab.py", argv, a.out)
    lines += ["", f"Whole target forwards ({threads} threads, context {a.context}, the layer runner; each after an "
              "untimed one of the same shape):", "",
              "| tokens | base min (ms) | this min (ms) | base median | this median | this ÷ base (min) | "
              "this ÷ base (median) | spread base / this |", "|---|---|---|---|---|---|---|---|"]
    for T in blocks:
        b, n = pooled(st, T, "base", k), pooled(st, T, "this", k)
        bm, nm = median_high(b), median_high(n)
        lines.append(f"| {T} | {min(b) * 1e3:.2f} | {min(n) * 1e3:.2f} | {bm * 1e3:.2f} | {nm * 1e3:.2f} | "
                     f"{min(n) / min(b):.2f}x | {nm / bm:.2f}x | {spread(st, T, 'base', k)} / "
                     f"{spread(st, T, 'this', k)} |")
    return write_report(lines, f"OMP_NUM_THREADS={threads} .venv/bin/python lab/measure/kernel_ab.py", argv, a.out)


def step_products(t: Transformer) -> list:
    """A target's products of one step (stacked projections split into their parts), each a QuantWeight."""
    from peagle.models import kernel_choice
    return [w for w in kernel_choice.parts(t._projections()) if isinstance(w, Q.QuantWeight)]


if __name__ == "__main__":
    sys.exit(main())
