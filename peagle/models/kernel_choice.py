"""Which of the C++ kernels' vector paths a product takes, by its row count, on the CPU at hand.

Invariant: the choice changes only the time. Every path gives a product the same bits (tests/test_quant.py), so
impl 0 (peagle/csrc/ops.h: AVX-512 from `avx512_min_rows` rows, one threshold per weight type and activation
kind) may follow whatever measures fastest. The widest path does not win everywhere: on a 2-core AMD EPYC with
AVX-512 (Zen 4) the AVX2 path's 1-row q4a8 products took 0.71x the AVX-512 path's time, and AVX-512 won from 4
rows (lab/measure/kernel_paths.py; since the AVX2 path's 8-bit products take vpdpbusd on ymm, from 5). So where
the CPU has AVX-512, a target's own products are timed on both paths when it loads (each kind's products inside
whole steps, row counts ROWS, interleaved rounds, min per cell; 3-7 s), and each kind's threshold is the one whose
choices cost least summed over the row counts, each relative to that row count's faster path. Every row count up
to 9 is timed: one between two timed counts takes the threshold's path unmeasured (timed at 4 and 6 rows only,
SmolLM2's q4a8 products went AVX2 below 6 rows on that EPYC, and its 5-row verify blocks ran AVX2 where AVX-512
was 1.25x faster). Kept in the kernels' build directory per CPU, thread count, kernel build, row counts timed,
the AVX2 path's form and step shapes, so a target is timed once per machine (said on stderr). Above the largest
row count timed AVX-512 stays (the default). PEAGLE_KERNEL_CHOICE=widest keeps AVX-512 at every row count
(nothing timed)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from . import quant as Q
from . import quant_ext

# (name, GGML type, 8-bit activations): every kind a product of the kernels can be
KINDS = (("f32", Q.F32, False), ("q4_0", Q.Q4_0, False), ("q4_1", Q.Q4_1, False), ("q8_0", Q.Q8_0, False),
         ("q4_0a8", Q.Q4_0, True), ("q4_1a8", Q.Q4_1, True), ("q8_0a8", Q.Q8_0, True))
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)        # row counts timed: decode, every verify block of K <= 8 and
                                                  # 9-position tree, small batches
ROUNDS = 7
CACHE_NAME = "kernel-choice.json"
_applied: dict = {}                                # key -> thresholds set in this process
_active: dict | None = None                        # the thresholds set last (activate)


def kind_name(qtype: int, act8: bool) -> str:
    return next(n for n, q, a in KINDS if q == qtype and a == act8)


def avx2_vnni() -> bool:
    """Whether the AVX2 path's 8-bit products take vpdpbusd on ymm (ops.h: avx2_vnni); False without kernels."""
    ext = quant_ext.get()
    return ext is not None and hasattr(ext, "avx2_vnni") and ext.avx2_vnni()


def cpu_key(threads: int) -> str:
    """The CPU (vendor, name, family / model / stepping: a VM may name every EPYC alike), thread count, kernel
    build, row counts timed and the AVX2 path's form (vpdpbusd or maddubs) that the thresholds hold for (a choice
    timed on fewer row counts, or for the other form, is timed again)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if not line.strip():
                    break
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    import platform
    cpu = " ".join(info.get(k, "?") for k in ("vendor_id", "model name")) if info else platform.processor()
    fms = "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping"))
    rows = ",".join(map(str, ROWS))
    form = " | avx2 vnni" if avx2_vnni() else ""
    return f"{cpu} ({fms}) | {threads} threads | build {quant_ext.source_hash()[:16]} | rows {rows}{form}"


def parts(projections) -> list:
    """A target's products of one step in order, stacked projections split into their parts."""
    return [p for w in projections for p in getattr(w, "parts", None) or [w] if hasattr(p, "qtype")]


def groups(projections) -> dict:
    """{kind name: [QuantWeight]} of a target's step."""
    out: dict = {}
    for p in parts(projections):
        out.setdefault(kind_name(p.qtype, p.act8), []).append(p)
    return out


def signature(by_kind: dict) -> str:
    """The step's products by kind and shape: targets of the same shapes share thresholds."""
    shapes = {k: sorted({(w.n, w.k) for w in ws}) for k, ws in by_kind.items()}
    text = ";".join(f"{k}:{len(by_kind[k])}:" + ",".join(f"{n}x{kk}" for n, kk in shapes[k]) for k in sorted(shapes))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def choose(times: dict, rows=None) -> int:
    """The AVX-512 threshold from {(rows, "avx2" | "avx512"): seconds}: least summed relative cost over `rows`
    (ROWS unless given); ties keep the smaller threshold (AVX-512 sooner, the default); AVX2 at every measured
    count gives the count after the largest (AVX-512 above, where nothing was measured)."""
    rows = rows or ROWS
    best, best_cost = rows[0], None
    for t in (*rows, rows[-1] + 1):
        cost = sum(times[m, "avx512" if m >= t else "avx2"] / min(times[m, "avx2"], times[m, "avx512"])
                   for m in rows)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = t, cost
    return best


def measure(ext, projections, rounds: int | None = None, rows=None) -> tuple[dict, dict]:
    """({kind: AVX-512 threshold}, {kind: {rows: [AVX2 ms, AVX-512 ms]}}): each kind's products timed on both
    paths inside whole steps (the other kinds' products run between them untimed, so a kind's weights meet the
    cache as in decoding: a 30 MB LM head alone would stay cached), each timed step after an untimed one (warm, as
    decoding re-reads them), interleaved rounds, min per cell. rounds, rows: ROUNDS, ROWS unless given."""
    rounds, rows = rounds or ROUNDS, rows or ROWS
    step = [(kind_name(w.qtype, w.act8), w) for w in parts(projections)]
    kinds = list(dict.fromkeys(k for k, _ in step))
    gen = torch.Generator().manual_seed(0)
    xs = {(m, k): torch.randn(m, k, generator=gen) for m in rows for k in {w.k for _, w in step}}
    best: dict = {}
    for _ in range(rounds):
        for name in kinds:
            for m in rows:
                for path, impl in (("avx2", 2), ("avx512", 3)):
                    for _pass in (False, True):
                        dt = 0.0
                        for k, w in step:
                            t0 = time.perf_counter()
                            Q.qmm(xs[m, w.k], w, impl if k == name else 0)
                            if k == name:
                                dt += time.perf_counter() - t0
                    best[name, m, path] = min(best.get((name, m, path), dt), dt)
    thresholds = {k: choose({(m, p): best[k, m, p] for m in rows for p in ("avx2", "avx512")}, rows) for k in kinds}
    times = {k: {m: [round(best[k, m, p] * 1e3, 3) for p in ("avx2", "avx512")] for m in rows} for k in kinds}
    return thresholds, times


def _read(fn: str) -> dict:
    try:
        with open(fn) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}                          # none yet, or unreadable: measured again


def usable(kept, by_kind: dict) -> bool:
    """A kept entry holds a threshold (a whole number >= 1) for every kind of the step, nothing else."""
    th = kept.get("thresholds") if isinstance(kept, dict) else None
    return (isinstance(th, dict) and set(th) == set(by_kind)
            and all(type(t) is int and t >= 1 for t in th.values()))


def apply(ext, thresholds: dict) -> None:
    global _active
    for name, qtype, act8 in KINDS:
        if name in thresholds:
            ext.set_avx512_min_rows(qtype, act8, int(thresholds[name]))
    _active = thresholds


def activate(thresholds: dict) -> None:
    """Set a target's thresholds again where another target of the process set its own since (a kind two
    targets share, e.g. a Q8_0 LM head, may have another threshold in each); a no-op otherwise."""
    if thresholds is not _active:
        apply(quant_ext.get(), thresholds)


def ensure(projections, log=None) -> dict | None:
    """Set impl 0's thresholds for the kinds of a target's products (measured on them now when none are kept for
    this CPU, thread count, build and step shapes); returns them, or None where there is nothing to
    choose (no kernels, no AVX-512, no kernel products, PEAGLE_KERNEL_CHOICE=widest)."""
    ext = quant_ext.get()
    by_kind = groups(projections)
    if ext is None or not ext.has_avx512() or not by_kind or os.environ.get("PEAGLE_KERNEL_CHOICE") == "widest":
        return None
    key = f"{cpu_key(torch.get_num_threads())} | step {signature(by_kind)}"
    if key in _applied:
        apply(ext, _applied[key])
        return _applied[key]
    fn = os.path.join(quant_ext.BUILD_DIR, CACHE_NAME)
    kept = _read(fn).get(key)
    if not usable(kept, by_kind):
        log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        log(f"peagle: timing the C++ kernels' AVX2 and AVX-512 paths on this target's products "
            f"({torch.get_num_threads()} threads; once per CPU, thread count and step shapes) ...")
        t0 = time.perf_counter()
        thresholds, times = measure(ext, projections)
        kept = {"thresholds": thresholds, "ms": times, "seconds": round(time.perf_counter() - t0, 1)}
        log(f"peagle: kernel paths: {summary(thresholds)} ({kept['seconds']} s; kept in {fn})")
        tmp = f"{fn}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(_read(fn) | {key: kept}, f, indent=1)
            os.replace(tmp, fn)
        except OSError as e:               # a read-only home: the choice holds for this process only
            log(f"peagle: note: the kernel path choice is not kept ({e})")
            if os.path.exists(tmp):
                os.remove(tmp)
    apply(ext, kept["thresholds"])
    _applied[key] = kept["thresholds"]
    return kept["thresholds"]


def summary(thresholds: dict) -> str:
    """One phrase: where impl 0 leaves AVX-512 ("AVX-512 at every row count" where it never does); an 8-bit
    kind's AVX2 path named "AVX2+VNNI" where it takes vpdpbusd on ymm (ops.h: avx2_vnni)."""
    vnni = avx2_vnni()
    a8 = {n for n, _, act8 in KINDS if act8}
    below = [f"{n} {'AVX2+VNNI' if vnni and n in a8 else 'AVX2'} below {t} rows"
             for n, t in thresholds.items() if t > 1]
    return ", ".join(below) if below else "AVX-512 at every row count"
