// AVX2 + FMA + F16C path (chosen at run time when the CPU has them). No torch headers here: this translation unit
// is compiled for AVX2 through the target pragma, and nothing inline from elsewhere may be compiled with it.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant_avx2_inline.h"
#include "quant_kernels.h"

namespace peagle_quant {
namespace avx2 {

// One block of 32 weights as four vectors of 8 (lanes 0-7, 8-15, 16-23, 24-31).
template <int QT>
static inline __attribute__((always_inline)) void dequant_block(const uint8_t* b, __m256* w) {
  if constexpr (QT == Q8_0) {
    const __m256 d = _mm256_set1_ps(h2f(b));
    #pragma GCC unroll 16
    for (int c = 0; c < 4; c++) {
      __m128i q = _mm_loadl_epi64((const __m128i*)(b + 2 + 8 * c));
      w[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    return;
  }
  const __m128i m4 = _mm_set1_epi8(0x0f);
  if constexpr (QT == Q4_1) {
    const __m256 d = _mm256_set1_ps(h2f(b)), m = _mm256_set1_ps(h2f(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + 4));
    const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
    return;
  }
  // Q4_0
  const __m256 d = _mm256_set1_ps(h2f(b));
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + 2)), e8 = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), e8);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), e8);
  w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
  w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
  w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
  w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
}

// One row, NO outputs: each block dequantized in registers and multiplied in at once (no scratch). Per output
// one accumulator: lanes l of chunks 0..3 of each block, in order (the same order as tile() below).
template <int QT, int NO>
static inline void row_fused(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, float* y) {
  constexpr int bs = block_bytes(QT);
  __m256 acc[NO], wv[4];
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++) acc[o] = _mm256_setzero_ps();
  for (int64_t k = 0, off = 0; k < K; k += 32, off += bs) {
    #pragma GCC unroll 16
    for (int o = 0; o < NO; o++) {
      dequant_block<QT>(w + o * row_bytes + off, wv);
      #pragma GCC unroll 16
      for (int c = 0; c < 4; c++) acc[o] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + k + 8 * c), acc[o]);
    }
  }
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++) y[o] = fold(acc[o]);
}

template <int QT>
static void dequant_row(const uint8_t* row, int64_t K, float* dst) {
  constexpr int bs = block_bytes(QT);
  __m256 w[4];
  for (int64_t k = 0; k < K; k += 32, row += bs) {
    dequant_block<QT>(row, w);
    #pragma GCC unroll 16
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(dst + k + 8 * c, w[c]);
  }
}

// NO dequantized outputs (buf rows, K apart) against NR activation rows: NO*NR accumulators, each a
// (row, output) pair's, chunk by chunk in order.
template <int NO, int NR, bool PACKED = false>
static inline void tile(const float* buf, const float* x, int64_t K, float* y, int64_t N, int nv = NO,
                        const float* next = nullptr, int64_t share = 0, int64_t tiles = 1) {
  // PACKED: buf is output 0's first chunk in an F32 group packed by 8 (quant_kernels.h): chunk k/8 of output o
  // at buf + 8k + 8o; else buf holds NO rows K apart. Only the first nv outputs are stored (a padded group).
  // next (PACKED): the same outputs' chunks in the next group, prefetched into L2 at the steps s with
  // s % tiles == share (this tile's share; see linear_rows_f32).
  __m256 acc[NR][NO];
  #pragma GCC unroll 16
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 16
    for (int o = 0; o < NO; o++) acc[r][o] = _mm256_setzero_ps();
  PrefetchShare pf{share, tiles};
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NO];
    #pragma GCC unroll 16
    for (int o = 0; o < NO; o++) wv[o] = _mm256_loadu_ps(PACKED ? buf + 8 * k + 8 * o : buf + o * K + k);
    if (PACKED && next != nullptr && pf.due())
      for (int o = 0; o < NO; o += 2) _mm_prefetch((const char*)(next + 8 * k + 8 * o), _MM_HINT_T1);
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      #pragma GCC unroll 16
      for (int o = 0; o < NO; o++) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 16
    for (int o = 0; o < NO; o++)
      if (o < nv) y[r * N + o] = fold(acc[r][o]);
}

// NR rows (2..8), NO outputs: each block dequantized in registers once per output and multiplied into every
// row at once (no scratch); per (row, output) one accumulator, chunk by chunk in order (as row_fused and tile).
// Up to 8 rows this measures faster than the scratch + tile path below; past 8, re-dequantizing per 8 rows costs
// more than the scratch round trip (docs/benchmarks/cpu-step.md).
template <int QT, int NO, int NR>
static inline void rows_fused(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, float* y, int64_t N) {
  constexpr int bs = block_bytes(QT);
  __m256 acc[NO][NR], wv[4];
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++)
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) acc[o][r] = _mm256_setzero_ps();
  for (int64_t k = 0, off = 0; k < K; k += 32, off += bs) {
    #pragma GCC unroll 16
    for (int o = 0; o < NO; o++) {
      dequant_block<QT>(w + o * row_bytes + off, wv);
      #pragma GCC unroll 16
      for (int r = 0; r < NR; r++)
        #pragma GCC unroll 16
        for (int c = 0; c < 4; c++)
          acc[o][r] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + r * K + k + 8 * c), acc[o][r]);
    }
  }
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++)
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) y[r * N + o] = fold(acc[o][r]);
}

// M rows (1..8) of NO outputs: pairs of outputs up to 4 rows, single outputs up to 8 (the accumulators fit the
// 16 registers).
template <int QT, int NO>
static void outputs_few(const uint8_t* w, int64_t rb, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  if (M <= 4 && NO % 2 == 0) {
    for (int o = 0; o < NO; o += 2) {
      const uint8_t* wo = w + o * rb;
      if (M == 2) rows_fused<QT, 2, 2>(wo, rb, x, K, y + o, N);
      else if (M == 3) rows_fused<QT, 2, 3>(wo, rb, x, K, y + o, N);
      else rows_fused<QT, 2, 4>(wo, rb, x, K, y + o, N);
    }
    return;
  }
  for (int o = 0; o < NO; o++) {
    const uint8_t* wo = w + o * rb;
    float* yo = y + o;
    switch (M) {
      case 2: rows_fused<QT, 1, 2>(wo, rb, x, K, yo, N); break;
      case 3: rows_fused<QT, 1, 3>(wo, rb, x, K, yo, N); break;
      case 4: rows_fused<QT, 1, 4>(wo, rb, x, K, yo, N); break;
      case 5: rows_fused<QT, 1, 5>(wo, rb, x, K, yo, N); break;
      case 6: rows_fused<QT, 1, 6>(wo, rb, x, K, yo, N); break;
      case 7: rows_fused<QT, 1, 7>(wo, rb, x, K, yo, N); break;
      default: rows_fused<QT, 1, 8>(wo, rb, x, K, yo, N); break;
    }
  }
}

template <int QT, int NO>
static void outputs(const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, float* y,
                    int64_t N, float* buf) {
  if (M == 1) return row_fused<QT, NO>(w, row_bytes, x, K, y);
  if (M <= 8) return outputs_few<QT, NO>(w, row_bytes, x, M, K, y, N);
  #pragma GCC unroll 16
  for (int o = 0; o < NO; o++) dequant_row<QT>(w + o * row_bytes, K, buf + o * K);
  int64_t r = 0;
  for (; r + 3 <= M; r += 3) tile<NO, 3>(buf, x + r * K, K, y + r * N, N);
  if (M - r == 2) tile<NO, 2>(buf, x + r * K, K, y + r * N, N);
  if (M - r == 1) tile<NO, 1>(buf, x + r * K, K, y + r * N, N);
}

// F32, packed by 8 (quant_kernels.h). Up to 8 activation rows, a group's 8 outputs against one activation row at a
// time (8 accumulators; the group, 8 x 4K bytes, is read from memory once as one stream and from L1 for further
// rows); more rows, 4 outputs x 3 rows per register tile (7 loads per 12 FMAs instead of 9 per 8). Measured on
// a 2-core AMD EPYC Zen 3 (the 49152 x 576 LM head, interleaved): 1-8 rows 8x1 as fast or faster, 16-64 rows
// 4x3 15-25 % faster. Per (row, output) the same FMA chain, chunk by chunk in order, either way. Several rows:
// each tile prefetches its share of the next group into L2 (see tile); this path on a 2-core Intel Xeon (it
// has not run on an AVX2-only CPU since), 120 SmolLM2-shaped products: 2 / 5 / 9 / 17 rows 16.5 / 19.1 / 26.0 /
// 34.4 -> 14.5 / 15.5 / 18.3 / 25.7 ms, 1 row 14.0-15.0 either way.
constexpr int64_t F32_TILE_ROWS = 8;

// Outputs n0..n1-1 (n0 a multiple of 8) of every row.
static void linear_rows_f32(const float* w, const float* x, int64_t M, int64_t K, float* y, int64_t N, int64_t n0,
                            int64_t n1) {
  for (int64_t n = n0; n < n1; n += 8) {
    const float* g = w + n * K;                // group n/8
    const int nv = (int)std::min<int64_t>(8, n1 - n);
    // several rows: each tile prefetches its share of the next group (as the AVX-512 path's group_f32)
    const float* next = M > 1 && n + 8 < n1 ? g + 8 * K : nullptr;
    if (M > F32_TILE_ROWS) {
      const int64_t tiles = (M + 2) / 3;
      for (int h = 0; h < 8 && h < nv; h += 4) {
        const float* nh = next ? next + 8 * h : nullptr;
        int64_t r = 0;
        const float* gh = g + 8 * h;
        for (; r + 3 <= M; r += 3) tile<4, 3, true>(gh, x + r * K, K, y + r * N + n + h, N, nv - h, nh, r / 3, tiles);
        if (M - r == 2) tile<4, 2, true>(gh, x + r * K, K, y + r * N + n + h, N, nv - h, nh, r / 3, tiles);
        if (M - r == 1) tile<4, 1, true>(gh, x + r * K, K, y + r * N + n + h, N, nv - h, nh, r / 3, tiles);
      }
    } else {
      for (int64_t r = 0; r < M; r++) tile<8, 1, true>(g, x + r * K, K, y + r * N + n, N, nv, next, r, M);
    }
  }
}

template <int QT>
static void linear_rows_t(const uint8_t* w, int64_t rb, const float* x, int64_t M, int64_t K, float* y,
                          int64_t N, int64_t n0, int64_t n1, float* buf) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) outputs<QT, 4>(w + n * rb, rb, x, M, K, y + n, N, buf);
  switch (n1 - n) {
    case 3: outputs<QT, 3>(w + n * rb, rb, x, M, K, y + n, N, buf); break;
    case 2: outputs<QT, 2>(w + n * rb, rb, x, M, K, y + n, N, buf); break;
    case 1: outputs<QT, 1>(w + n * rb, rb, x, M, K, y + n, N, buf); break;
    default: break;
  }
}

void linear_rows(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* buf) {
  // buf: 4*K floats
  if (qtype == Q4_0) return linear_rows_t<Q4_0>(w, row_bytes, x, M, K, y, N, n0, n1, buf);
  if (qtype == Q4_1) return linear_rows_t<Q4_1>(w, row_bytes, x, M, K, y, N, n0, n1, buf);
  if (qtype == F32) return linear_rows_f32((const float*)w, x, M, K, y, N, n0, n1);
  return linear_rows_t<Q8_0>(w, row_bytes, x, M, K, y, N, n0, n1, buf);
}

// e^x for any x (clamped to [-87, 88]), 8 lanes.
static inline __m256 exp8(__m256 x) {
  return exp8_clamped(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
}

// o = a / (1 + e^-a) * b elementwise (the tail through one padded vector: every element takes the same ops).
void silu_mul(const float* a, const float* b, float* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    const __m256 e = exp8(_mm256_xor_ps(av, neg));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(av, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i)));
  }
  if (i < n) {
    alignas(32) float ta[8] = {0}, tb[8] = {0}, to[8];
    std::memcpy(ta, a + i, (n - i) * 4);
    std::memcpy(tb, b + i, (n - i) * 4);
    const __m256 av = _mm256_load_ps(ta);
    const __m256 e = exp8(_mm256_xor_ps(av, neg));
    _mm256_store_ps(to, _mm256_mul_ps(_mm256_div_ps(av, _mm256_add_ps(one, e)), _mm256_load_ps(tb)));
    std::memcpy(o + i, to, (n - i) * 4);
  }
}

}  // namespace avx2
}  // namespace peagle_quant
