// The 8-bit-activation products on the packed layout at ymm width (quant_kernels.h: the arithmetic and the
// layout; quant_scalar.cpp: the same operations one output at a time on GGUF's own blocks), shared by the AVX2
// translation unit (quant_a8_avx2.cpp: maddubs + madd) and the VNNI one (quant_a8_vnni256.cpp: dpbusd on ymm), so
// both run the same float operations in the same order. A vector lane is an output: in a group-block, 4 weight
// bytes of each of 8 outputs share one 32-byte row, so one multiply-add against 4 activation bytes broadcast to
// every lane gives each output its own sums. Per block one conversion and one fused multiply-add by d_w * xd for
// all 8 outputs. Each translation unit including it is compiled with its target pragma first; nothing else may.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "quant_kernels.h"

namespace peagle_quant {
namespace a8ymm {

static inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(load4(p)); }

static inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// Every output's integer dot product with NR rows (32 activation bytes each, K apart) over one group-block's
// weights qs: dots[r] lane o = output o's block sum for row r (each weight vector unpacked once for all rows).
// Dot: how 4 weight bytes x 4 activation bytes per lane are summed (MaddDot: maddubs + madd, AVX2; VnniDot:
// dpbusd on ymm, AVX-512 VL + VNNI). Both give each lane the same exact integer, however they split the sum.
template <class Dot, int QT, int NR>
static inline void block_dots(const uint8_t* qs, const int8_t* x, int64_t K, __m256i* dots) {
  constexpr int NA = Dot::accumulators(NR);
  __m256i s[NR][NA];
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 4
    for (int a = 0; a < NA; a++) s[r][a] = _mm256_setzero_si256();
  if constexpr (QT == Q8_0) {
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __asm__("" : "+x"(w));   // one load in a register: GCC would fold a second load into a sign
      const __m256i u = _mm256_sign_epi8(w, w);
      #pragma GCC unroll 4
      for (int r = 0; r < NR; r++) Dot::q8(s[r][c % NA], u, _mm256_sign_epi8(bcast4(x + r * K + 4 * c), w));
    }
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __asm__("" : "+x"(w));   // one load: GCC would fold a second one into the mask
      const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
      #pragma GCC unroll 4
      for (int r = 0; r < NR; r++) {
        Dot::q4(s[r][2 * c % NA], lo, bcast4(x + r * K + 4 * c));
        Dot::q4(s[r][(2 * c + 1) % NA], hi, bcast4(x + r * K + 16 + 4 * c));
      }
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) dots[r] = Dot::template finish<QT, NA>(s[r]);
}

// One group (8 outputs) x NR rows (K apart in xq, nb apart in xd / xs); writes the first `valid` outputs.
template <class Dot, int QT, int NR>
static inline void group(const uint8_t* g, int64_t gs, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                         float* y, int64_t N, int valid) {
  constexpr int gb = a8_group_block_bytes(QT), qoff = QT == Q4_1 ? 32 : 16;
  const int64_t nb = K / 32;
  __m256 acc[NR], s[NR];
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps(), s[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * gb;
    prefetch_ahead(blk, gs, gb, 1);   // gs: the groups' byte distance
    const __m256 d = halves8(blk);
    __m256i dots[NR];
    block_dots<Dot, QT, NR>(blk + qoff, xq + b * 32, K, dots);
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
      const __m256 dd = _mm256_mul_ps(d, _mm256_broadcast_ss(xd + r * nb + b));
      acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dots[r]), acc[r]);
    }
    // the minimum terms (Q4_1's m, Q4_0's -8 d): per output and row their own chain of fma in block order, in
    // the same pass (a second pass over the group kept an fma chain's latency apart from the products: AVX2 Zen 3)
    if constexpr (QT != Q8_0) {
      const __m256 m = QT == Q4_1 ? halves8(blk + 16) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
      #pragma GCC unroll 4
      for (int r = 0; r < NR; r++) s[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + r * nb + b), s[r]);
    }
  }
  __m256 v[NR];   // stored whole where the group has 8 outputs, else through a buffer
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) v[r] = QT == Q8_0 ? acc[r] : _mm256_add_ps(acc[r], s[r]);
  if (valid == 8) {
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + r * N, v[r]);
    return;
  }
  alignas(32) float out[NR][8];
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) _mm256_store_ps(out[r], v[r]);
  for (int r = 0; r < NR; r++)
    for (int o = 0; o < valid; o++) y[r * N + o] = out[r][o];
}

// Groups g0..g1-1 of all M rows, rows in tiles of up to 4 (each group-block's weights meet 4 rows per read).
template <class Dot, int QT>
static void groups_t(const uint8_t* p, const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                     float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t gstride = K / 32 * a8_group_block_bytes(QT), nb = K / 32;
  for (int64_t gi = g0; gi < g1; gi++) {
    const uint8_t* g = p + gi * gstride;
    const int valid = (int)(N - 8 * gi < 8 ? N - 8 * gi : 8);
    float* yg = y + 8 * gi;
    for (int64_t r = 0; r < M; r += 4) {
      const int64_t nr = M - r < 4 ? M - r : 4;
      const int8_t* xr = xq + r * K;
      const float *dr = xd + r * nb, *sr = xs + r * nb;
      float* yr = yg + r * N;
      if (nr == 4) group<Dot, QT, 4>(g, gstride, xr, dr, sr, K, yr, N, valid);
      else if (nr == 3) group<Dot, QT, 3>(g, gstride, xr, dr, sr, K, yr, N, valid);
      else if (nr == 2) group<Dot, QT, 2>(g, gstride, xr, dr, sr, K, yr, N, valid);
      else group<Dot, QT, 1>(g, gstride, xr, dr, sr, K, yr, N, valid);
    }
  }
}

// Groups g0..g1-1 of every row for a weight type (each translation unit's linear_groups_a8 with its Dot).
template <class Dot>
static void linear_groups(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                          int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  if (qtype == Q4_0) return groups_t<Dot, Q4_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  if (qtype == Q4_1) return groups_t<Dot, Q4_1>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  return groups_t<Dot, Q8_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
}

}  // namespace a8ymm
}  // namespace peagle_quant
