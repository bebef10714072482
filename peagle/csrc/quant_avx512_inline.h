// The float part of the 8-bit-activation products on zmm, shared by the AVX-512 path (quant_avx512.cpp: dots from
// dpbusd) and the AMX path (quant_amx.cpp: dots from the tile unit), so both run the same operations in the same
// order; halves16 also serves the float-activation path of the block types (quant_f_avx512.cpp). Each translation unit including it is compiled with an AVX-512 target pragma first; nothing else may.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "quant_kernels.h"

namespace peagle_quant {
namespace avx512 {

// The fp16 values at p (group g's 8) and p + gs (group g+1's) as one zmm.
static inline __m512 halves16(const uint8_t* p, int64_t gs) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                                 _mm_loadu_si128((const __m128i*)(p + gs)), 1));
}

// Block b of a pair of groups (blk: its group-block in pack_a8's layout, gs: the second group's distance), NR
// rows' exact integer dots -> acc[r] = fma(d_w * xd[r, b], dot, acc[r]); Q4: s[r] = fma(m_w, xs[r, b], s[r]).
template <int QT, int NR>
static inline void a8_block(const uint8_t* blk, int64_t gs, const __m512i* dots, const float* xd, const float* xs,
                            int64_t nb, int64_t b, __m512* acc, __m512* s) {
  const __m512 d = halves16(blk, gs);
  #pragma GCC unroll 16
  for (int r = 0; r < NR; r++) {
    const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b]));
    acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dots[r]), acc[r]);
  }
  if constexpr (QT != Q8_0) {
    const __m512 m = QT == Q4_1 ? halves16(blk + 16, gs) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) s[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), s[r]);
  }
}

// y[r, o] = acc + s (Q8_0: acc) for the first `rows` rows and `valid` outputs of the pair.
template <int QT>
static inline void a8_store(const __m512* acc, const __m512* s, int rows, float* y, int64_t N, int valid) {
  for (int r = 0; r < rows; r++) {
    alignas(64) float out[16];
    _mm512_store_ps(out, QT == Q8_0 ? acc[r] : _mm512_add_ps(acc[r], s[r]));
    for (int o = 0; o < valid; o++) y[r * N + o] = out[o];
  }
}

}  // namespace avx512
}  // namespace peagle_quant
