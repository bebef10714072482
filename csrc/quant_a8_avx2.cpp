// AVX2 path of the 8-bit-activation products (quant_kernels.h: the arithmetic; quant_scalar.cpp: the same
// operations one lane at a time). A block's 32 weight bytes meet the row's 32 activation bytes in one
// maddubs (unsigned x signed byte pairs -> 16-bit) and one madd by ones (-> 8 lanes of 32-bit sums of 4
// products, exact), then one conversion and one fused multiply-add by the block's scale per lane. Q4 nibbles
// are the unsigned operand as they are; Q8_0 weights go through the sign trick (|w| unsigned, x * sign(w)).
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "quant_avx2_inline.h"
#include "quant_kernels.h"

namespace peagle_quant {
namespace avx2 {

template <int QT>
constexpr int bytes() { return QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34; }

// Weights of one block as the unsigned maddubs operand: Q4 nibbles in order (weights 0-15 low, 16-31 high);
// Q8_0: |w| (sign applied to the activations in dot()).
template <int QT>
static inline __m256i weights(const uint8_t* blk, __m256i* sgn) {
  if constexpr (QT == Q8_0) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 2));
    *sgn = w;
    return _mm256_sign_epi8(w, w);
  } else {
    // the 16 bytes in both halves (a broadcast load), the upper half shifted by 4: low nibbles | high nibbles
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + (QT == Q4_1 ? 4 : 2))));
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    return _mm256_and_si256(_mm256_srlv_epi32(q, shift), _mm256_set1_epi8(0x0f));
  }
}

// A Q4 block's minimum: Q4_1's m, Q4_0's -8 d (exact).
template <int QT>
static inline float min_of(const uint8_t* blk) {
  return QT == Q4_1 ? h2f(blk + 2) : h2f(blk) * -8.0f;
}

template <int QT>
static inline __m256 dot(__m256i u, __m256i sgn, const int8_t* x) {
  __m256i xv = _mm256_loadu_si256((const __m256i*)x);
  if constexpr (QT == Q8_0) xv = _mm256_sign_epi8(xv, sgn);
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(p);
}

// NO outputs x NR rows (each row K apart in xq, nb apart in xd / xs, N apart in y).
template <int QT, int NO, int NR>
static inline void tile(const uint8_t* w, int64_t rb, const int8_t* xq, const float* xd, const float* xs,
                        int64_t K, float* y, int64_t N) {
  constexpr int bs = bytes<QT>();
  const int64_t nb = K / 32;
  __m256 acc[NO][NR];
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++)
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) acc[o][r] = _mm256_setzero_ps();
  // the minimum terms: per (output, row) one chain of fma in block order; one row: in the main loop (the NO
  // chains interleave with its work), more rows: after it, the NO x NR chains interleaved (the accumulators
  // already fill the registers). The same operations in the same order either way.
  float s[NO][NR] = {};
  for (int64_t b = 0; b < nb; b++) {
    #pragma GCC unroll 16
    for (int o = 0; o < NO; o++) {
      const uint8_t* blk = w + o * rb + b * bs;
      __m256i sgn = _mm256_setzero_si256();
      const __m256i u = weights<QT>(blk, &sgn);
      const __m256 dw = _mm256_set1_ps(h2f(blk));
      #pragma GCC unroll 16
      for (int r = 0; r < NR; r++) {
        const __m256 dd = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + r * nb + b));
        acc[o][r] = _mm256_fmadd_ps(dd, dot<QT>(u, sgn, xq + r * K + b * 32), acc[o][r]);
      }
      if constexpr (QT != Q8_0 && NR == 1) s[o][0] = std::fma(min_of<QT>(blk), xs[b], s[o][0]);
    }
  }
  if constexpr (QT != Q8_0 && NR > 1) {
    for (int64_t b = 0; b < nb; b++) {
      #pragma GCC unroll 16
      for (int o = 0; o < NO; o++) {
        const float m = min_of<QT>(w + o * rb + b * bs);
        #pragma GCC unroll 16
        for (int r = 0; r < NR; r++) s[o][r] = std::fma(m, xs[r * nb + b], s[o][r]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++)
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) y[r * N + o] = fold(acc[o][r]) + s[o][r];
}

// NO outputs (1..4) of all M rows: one row with all NO outputs at once; more rows in tiles of up to 4 rows x 2
// outputs (the accumulators fit the 16 registers).
template <int QT, int NO>
static void outputs(const uint8_t* w, int64_t rb, const int8_t* xq, const float* xd, const float* xs, int64_t M,
                    int64_t K, float* y, int64_t N) {
  if (M == 1) return tile<QT, NO, 1>(w, rb, xq, xd, xs, K, y, N);
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < M; r += 4) {
    const int64_t nr = M - r < 4 ? M - r : 4;
    const int8_t* xr = xq + r * K;
    const float *dr = xd + r * nb, *sr = xs + r * nb;
    float* yr = y + r * N;
    for (int o = 0; o < NO; o += 2) {
      const uint8_t* wo = w + o * rb;
      if (o + 1 < NO) {
        if (nr == 4) tile<QT, 2, 4>(wo, rb, xr, dr, sr, K, yr + o, N);
        else if (nr == 3) tile<QT, 2, 3>(wo, rb, xr, dr, sr, K, yr + o, N);
        else if (nr == 2) tile<QT, 2, 2>(wo, rb, xr, dr, sr, K, yr + o, N);
        else tile<QT, 2, 1>(wo, rb, xr, dr, sr, K, yr + o, N);
      } else {
        if (nr == 4) tile<QT, 1, 4>(wo, rb, xr, dr, sr, K, yr + o, N);
        else if (nr == 3) tile<QT, 1, 3>(wo, rb, xr, dr, sr, K, yr + o, N);
        else if (nr == 2) tile<QT, 1, 2>(wo, rb, xr, dr, sr, K, yr + o, N);
        else tile<QT, 1, 1>(wo, rb, xr, dr, sr, K, yr + o, N);
      }
    }
  }
}

template <int QT>
static void rows_t(const uint8_t* w, int64_t rb, const int8_t* xq, const float* xd, const float* xs, int64_t M,
                   int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) outputs<QT, 4>(w + n * rb, rb, xq, xd, xs, M, K, y + n, N);
  switch (n1 - n) {
    case 3: outputs<QT, 3>(w + n * rb, rb, xq, xd, xs, M, K, y + n, N); break;
    case 2: outputs<QT, 2>(w + n * rb, rb, xq, xd, xs, M, K, y + n, N); break;
    case 1: outputs<QT, 1>(w + n * rb, rb, xq, xd, xs, M, K, y + n, N); break;
    default: break;
  }
}

void linear_rows_a8(int qtype, const uint8_t* w, int64_t rb, const int8_t* xq, const float* xd, const float* xs,
                    int64_t M, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  if (qtype == Q4_0) return rows_t<Q4_0>(w, rb, xq, xd, xs, M, K, y, N, n0, n1);
  if (qtype == Q4_1) return rows_t<Q4_1>(w, rb, xq, xd, xs, M, K, y, N, n0, n1);
  return rows_t<Q8_0>(w, rb, xq, xd, xs, M, K, y, N, n0, n1);
}

}  // namespace avx2
}  // namespace peagle_quant
