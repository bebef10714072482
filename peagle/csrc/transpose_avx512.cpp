// AVX-512 path of the transposing copy (transpose.h): 16 x 16 tiles, each loaded as 16 float32 rows, transposed in
// registers (unpack, in-lane shuffle, then two 128-bit lane shuffles) and stored as 16 columns. Exact: a
// permutation, plus bfloat16 <-> float32 conversions (widening is exact; narrowing rounds to nearest even).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include <immintrin.h>

#include <cstdint>

#include "bf16_inline.h"
#include "transpose.h"

namespace peagle_transpose {

namespace {

// r[i] = row i of a 16 x 16 tile -> r[c] = column c.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {        // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {        // rows g..g+3: r[g + j] holds element j of each lane's 4 columns
    r[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
    r[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
    r[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    r[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  __m512 o[16];
  for (int j = 0; j < 4; j++) {            // column 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512 s0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), s1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    const __m512 s2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 s3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    o[j] = _mm512_shuffle_f32x4(s0, s2, 0x88);
    o[8 + j] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
    o[4 + j] = _mm512_shuffle_f32x4(s1, s3, 0x88);
    o[12 + j] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = o[i];
}

}  // namespace

void transpose_avx512(const void* src, bool src_bf16, int64_t R, int64_t C, void* dst, bool dst_bf16, int64_t ldd,
                      int64_t c0, int64_t c1) {
  constexpr int64_t RB = 128;   // rows per band: its reads are whole row segments, each column's writes a run
  __m512 r[16];
  for (int64_t rb = 0; rb < ldd; rb += RB)
    for (int64_t c = c0; c < c1; c += 16)
      for (int64_t r0 = rb; r0 < ldd && r0 < rb + RB; r0 += 16) {
        for (int i = 0; i < 16; i++)
          r[i] = r0 + i < R ? peagle_bf16::load16(src, src_bf16, (r0 + i) * C + c) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; i++) peagle_bf16::store16(dst, dst_bf16, (c + i) * ldd + r0, r[i]);
      }
}

}  // namespace peagle_transpose
