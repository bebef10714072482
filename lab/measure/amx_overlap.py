"""Whether the tile unit's work overlaps vector work on this core: the probe behind keeping the 8-bit-activation
products of fewer than 16 rows off the AMX path (peagle/csrc/ops.h: AMX_MIN_ROWS).

An 8-row AMX product per pair of groups and block pair loads two tiles, runs one TDPBSUD and stores the int32 dots
(one 1 KB C tile) for the float part to read back; the AVX-512 path does the same dots with vpdpbusd on zmm. Each
loop below runs one shape of that work on one thread with its data in L1 and reports nanoseconds per iteration:
zmm FMAs alone (24 per iteration in 12 independent chains), vpdpbusd alone (the same), the tile work without its
store, the store alone and the whole sequence, each alone and with the FMAs in the same iteration. Where two
kinds of work overlap, together costs about the larger of the two; where they serialise, about their sum.

A plain C++ probe (no torch headers) compiled here with g++ into build/amx-overlap/ and called through ctypes.
Prints a markdown table; exits 0 with a line saying so where the CPU or the OS grants no AMX.

    .venv/bin/python lab/measure/amx_overlap.py --out docs/benchmarks/amx-overlap.md
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab.measure.kernel_ab import cpu_model
from lab.measure.precision import write_report
from peagle.errors import PeagleError
from peagle.paths import HOME

SOURCE = r'''
#include <algorithm>
#include <chrono>
#include <cstdint>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#include <immintrin.h>

#include "amx_inline.h"   // peagle/csrc: the kernels' tile configuration

alignas(64) static uint8_t A[16][1024], B[16][1024];
alignas(64) static int32_t C[16][256];

// shape bits: 1 = tile zero + two tile loads + TDPBSUD, 2 = the C tile's store, 4 = 24 zmm FMAs, 8 = 24 vpdpbusd.
// The tiles are configured inside the loop's own call (a library call in between, lazy binding's state save
// included, may leave them unconfigured) and released after it.
template <int S>
__attribute__((noinline)) float loop(long n) {
  if (S & 3) peagle_amx::configure_tiles(8);
  __m512 f[12];
  __m512i d[12];
  for (int j = 0; j < 12; j++) f[j] = _mm512_set1_ps(1.0f + j), d[j] = _mm512_set1_epi32(j);
  const __m512 fa = _mm512_set1_ps(0.999f), fb = _mm512_set1_ps(0.001f);
  const __m512i da = _mm512_set1_epi8(1), db = _mm512_set1_epi8(2);
  for (long i = 0; i < n; i++) {
    const int k = i & 15;
    if (S & 1) { _tile_zero(0); _tile_loadd(2, A[k], 64); _tile_loadd(4, B[k], 64); _tile_dpbsud(0, 2, 4); }
    if (S & 2) _tile_stored(0, C[k], 64);
    if (S & 4) {
      #pragma GCC unroll 12
      for (int j = 0; j < 12; j++) f[j] = _mm512_fmadd_ps(_mm512_fmadd_ps(f[j], fa, fb), fa, fb);
    }
    if (S & 8) {
      #pragma GCC unroll 12
      for (int j = 0; j < 12; j++) d[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d[j], da, db), da, db);
    }
  }
  if (S & 3) _tile_release();
  float s = 0;
  for (int j = 0; j < 12; j++) s += f[j][0] + (float)d[j][0];
  return s;
}

template <int S> double time_ns(long n) {
  volatile float sink = loop<S>(1000);
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    auto t0 = std::chrono::steady_clock::now();
    sink = loop<S>(n);
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
  }
  (void)sink;
  return best;
}

// ns per iteration of one loop shape (1-8: loop<shape>)
extern "C" double probe(int shape, long n) {
  switch (shape) {
    case 1: return time_ns<1>(n);
    case 2: return time_ns<2>(n);
    case 3: return time_ns<3>(n);
    case 4: return time_ns<4>(n);
    case 5: return time_ns<5>(n);
    case 6: return time_ns<6>(n);
    case 7: return time_ns<7>(n);
    default: return time_ns<8>(n);
  }
}
'''


def build() -> ctypes.CDLL:
    """The probe's shared library, compiled again when its source or peagle/csrc/amx_inline.h changed
    (build/amx-overlap/)."""
    out, csrc = os.path.join(HOME, "build", "amx-overlap"), os.path.join(HOME, "peagle", "csrc")
    os.makedirs(out, exist_ok=True)
    src, so = os.path.join(out, "probe.cpp"), os.path.join(out, "probe.so")
    if not (os.path.isfile(src) and open(src).read() == SOURCE and os.path.isfile(so)
            and os.path.getmtime(so) >= os.path.getmtime(os.path.join(csrc, "amx_inline.h"))):
        with open(src, "w") as f:
            f.write(SOURCE)
        p = subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-I", csrc, "-o", so, src], capture_output=True,
                           text=True)
        if p.returncode:
            raise PeagleError(f"compiling the AMX probe failed: {p.stderr.strip()[-400:]}")
    lib = ctypes.CDLL(so)
    lib.probe.restype, lib.probe.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long]
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200000, help="iterations per timed loop (min of 5 loops)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from peagle.models import quant_ext
    ext = quant_ext.get()
    if ext is None or not ext.has_amx():
        print("no AMX-INT8 tiles usable here (CPU flags, OS grant or peagle's kernels): nothing to probe")
        return 0
    lib = build()   # the tile data granted to this process: has_amx() asked the OS for it (quant_amx.cpp)
    ns = {s: lib.probe(s, a.iters) for s in range(1, 9)}
    rows = [("24 zmm FMAs (12 chains)", 4, None), ("24 zmm vpdpbusd (12 chains)", 8, None),
            ("tile zero, 2 tile loads, TDPBSUD", 1, None), ("  with the 24 FMAs", 5, (1, 4)),
            ("C tile store (1 KB)", 2, None), ("  with the 24 FMAs", 6, (2, 4)),
            ("the whole tile sequence with its store", 3, None), ("  with the 24 FMAs", 7, (3, 4))]
    lines = ["# Does the tile unit's work overlap vector work? (one thread, data in L1)", "",
             f"CPU: {cpu_model()}; min of 5 loops of {a.iters} iterations each.", "",
             "| loop body | ns / iteration | together ÷ the two alone: sum / larger |", "|---|---|---|"]
    for name, s, parts in rows:
        cmp = "-"
        if parts:
            x, y = (ns[p] for p in parts)
            cmp = f"{ns[s] / (x + y):.2f} / {ns[s] / max(x, y):.2f}"
        lines.append(f"| {name} | {ns[s]:.2f} | {cmp} |")
    lines += ["", "Overlapping work costs about the larger of its parts (÷ larger near 1), serialised work their "
              "sum (÷ sum near 1). The FMAs and vpdpbusd alone: 24 per iteration in 12 chains of 2."]
    return write_report(lines, ".venv/bin/python lab/measure/amx_overlap.py", argv, a.out)


if __name__ == "__main__":
    sys.exit(main())
