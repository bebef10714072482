// AVX-512 path (chosen at run time when the CPU has AVX-512 F/VL/BW/DQ and VNNI): the F32 product on zmm registers
// and the 8-bit-activation products through VNNI's dpbusd. Same layouts as the AVX2 path (quant_kernels.h) and
// the same bits: an F32 zmm holds two outputs' 8-lane accumulators side by side (each lane the same FMA chain
// as AVX2's); dpbusd sums a lane's 4 byte products into its 32-bit integer exactly, as maddubs + madd do
// (no pair of products of a nibble or a |Q8_0 weight| <= 128 with |x| <= 127 overflows 16 bits), and a zmm of
// a8 lanes holds two groups' 8 outputs. No torch headers.
#include <algorithm>   // the standard headers before the target pragma: none of their code is built for AVX-512
#include <cstring>
#include <vector>

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "quant_avx2_inline.h"
#include "quant_avx512_inline.h"
#include "quant_kernels.h"

namespace peagle_quant {
namespace avx512 {

using avx2::fold;

// F32 packed by 8: NR activation rows against one group's 8 outputs (zmm j = outputs 2j, 2j+1 of a chunk), the
// first nv outputs stored. PF (several rows, so several tiles per group after the first reads from L1): this
// tile prefetches its share of the next group (g + 8K) into L2, the steps s with s % tiles == share, so memory
// streams while the tiles compute and the next group's first tile finds it in cache. One row keeps to the
// hardware prefetcher (a pure stream: as fast). Into L2 rather than L1: L1 prefetches hold a line-fill buffer
// until their line arrives, which capped the stream below the one-row rate. Measured on a 2-core Intel Xeon
// (AVX-512), 120 [1536 x 576] products, 2 threads, against the first tile prefetching 1 KB ahead and the second
// the next group into L1: 2 / 4 / 5 / 8 / 9 rows 17.0 / 18.6 / 17.9 / 20.2 / 19.5 -> 14.5 / 15.5 / 15.6 / 17.1 /
// 16.7 ms (1 row 14.6 either way), the same bits.

template <int NR, bool PF>
static inline void group_f32(const float* g, const float* x, int64_t K, float* y, int64_t N, int nv, int share,
                             int tiles) {
  __m512 acc[NR][4];
  #pragma GCC unroll 16
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
  PrefetchShare ps{share, tiles};   // PF: this tile's steps of the next group
  for (int64_t k = 0; k < K; k += 8) {
    __m512 wv[4];
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_ps(g + 8 * k + 16 * j);
    if constexpr (PF) {
      if (ps.due()) {
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm_prefetch((const char*)(g + 8 * K + 8 * k + 16 * j), _MM_HINT_T1);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < NR; r++) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * K + k));
      #pragma GCC unroll 4
      for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      if (2 * j < nv) y[r * N + 2 * j] = fold(_mm512_castps512_ps256(acc[r][j]));
      if (2 * j + 1 < nv) y[r * N + 2 * j + 1] = fold(_mm512_extractf32x8_ps(acc[r][j], 1));
    }
}

template <int NR>
static inline void group_f32_pf(bool pf, const float* g, const float* x, int64_t K, float* y, int64_t N, int nv,
                                int share, int tiles) {
  if (pf) group_f32<NR, true>(g, x, K, y, N, nv, share, tiles);
  else group_f32<NR, false>(g, x, K, y, N, nv, 0, 1);
}

// Outputs n0..n1-1 (n0 a multiple of 8) of every row, rows in tiles of up to 4 per group (16 accumulators; a
// group's weights, 8 x 4K bytes, are read from memory once (several rows: prefetched while the previous group
// computes) and from L1 for further tiles).
static void linear_rows_f32(const float* w, const float* x, int64_t M, int64_t K, float* y, int64_t N, int64_t n0,
                     int64_t n1) {
  for (int64_t n = n0; n < n1; n += 8) {
    const float* g = w + n * K;
    const int nv = (int)std::min<int64_t>(8, n1 - n);
    for (int64_t r = 0; r < M; r += 4) {
      const float* xr = x + r * K;
      float* yr = y + r * N + n;
      const bool pf = M > 1 && n + 8 < n1;           // each tile a share of the next group (see group_f32)
      const int tiles = (int)((M + 3) / 4), share = (int)(r / 4);
      switch (std::min<int64_t>(4, M - r)) {
        case 4: group_f32_pf<4>(pf, g, xr, K, yr, N, nv, share, tiles); break;
        case 3: group_f32_pf<3>(pf, g, xr, K, yr, N, nv, share, tiles); break;
        case 2: group_f32_pf<2>(pf, g, xr, K, yr, N, nv, share, tiles); break;
        default: group_f32_pf<1>(pf, g, xr, K, yr, N, nv, share, tiles); break;
      }
    }
  }
}

// Two groups at once (16 outputs, zmm lanes 0-7 group g's, 8-15 group g+1's; gs: the groups' byte distance):
// every lane's dots the same integers as avx2::group's (quant_a8_avx2.cpp), twice the outputs per instruction.
// Q8_0 (signed weights): dpbusd multiplies unsigned bytes, so it takes w + 128 (w ^ 0x80, once per chunk for all
// rows) and the block's sum of the row's activations times 128 comes off at the end (xsum: those sums, row r's
// at xsum[r * nb]): the same exact integer as |w| times x with w's sign, which cost one more operation per row
// and chunk. Measured on a 2-core Intel Xeon (KVM, AVX-512 VNNI), SmolLM2's Q8_0 lm_head [49152 x 576]: 8 / 9 / 16
// rows 0.93 / 1.08 / 1.76 -> 0.82 / 0.88 / 1.49 ms, 1-4 rows unchanged (memory-bound).
template <int QT, int NR>
static inline void pair_dots(const uint8_t* q0, int64_t gs, const int8_t* x, int64_t K, const int32_t* xsum,
                             int64_t nb, __m512i* s) {
  #pragma GCC unroll 8
  for (int r = 0; r < NR; r++) s[r] = _mm512_setzero_si512();
  #pragma GCC unroll 8
  for (int c = 0; c < (QT == Q8_0 ? 8 : 4); c++) {
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(q0 + 32 * c))),
                                         _mm256_loadu_si256((const __m256i*)(q0 + gs + 32 * c)), 1);
    if constexpr (QT == Q8_0) {
      const __m512i u = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
      #pragma GCC unroll 8
      for (int r = 0; r < NR; r++) s[r] = _mm512_dpbusd_epi32(s[r], u, _mm512_set1_epi32(load4(x + r * K + 4 * c)));
    } else {
      const __m512i m4 = _mm512_set1_epi8(0x0f);
      const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
      #pragma GCC unroll 8
      for (int r = 0; r < NR; r++) {
        s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(load4(x + r * K + 4 * c)));
        s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(load4(x + r * K + 16 + 4 * c)));
      }
    }
  }
  if constexpr (QT == Q8_0) {
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = _mm512_sub_epi32(s[r], _mm512_set1_epi32(128 * xsum[r * nb]));
  }
}

template <int QT, int NR>
static inline void pair_a8(const uint8_t* g, int64_t gs, const int8_t* xq, const float* xd, const float* xs,
                           const int32_t* xsum, int64_t K, float* y, int64_t N, int valid) {
  constexpr int gb = a8_group_block_bytes(QT), qoff = QT == Q4_1 ? 32 : 16;
  const int64_t nb = K / 32;
  __m512 acc[NR], s[NR];
  #pragma GCC unroll 8
  for (int r = 0; r < NR; r++) acc[r] = s[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * gb;
    prefetch_ahead(blk, gs, gb, 2);   // the next pair's block
    __m512i dots[NR];
    pair_dots<QT, NR>(blk + qoff, gs, xq + b * 32, K, QT == Q8_0 ? xsum + b : nullptr, nb, dots);
    a8_block<QT, NR>(blk, gs, dots, xd, xs, nb, b, acc, s);
  }
  a8_store<QT>(acc, s, NR, y, N, valid);
}

// Groups g0..g1-1 of all M rows: pairs of groups in tiles of up to 8 rows (a pair's weights unpacked once per 8
// rows), a last odd group on the AVX2 path. Measured on a 2-core Intel Xeon (AVX-512 VNNI), SmolLM2's q4a8
// products: pairs 10-20 % faster than one group at a time at 1-8 rows, 8-row tiles ~15 % faster than 4 at 8 rows.
// A last tile of 9 rows runs as one (a 9-position verify, a 4x8 tree): a q4a8 SmolLM2 forward of 9 rows cost
// 0.71-0.77 ms over 8 rows instead of 0.99-1.09 (the 1-row tile's single accumulator chain).
constexpr int TR = 8;
template <int QT>
static void groups_t(const uint8_t* p, const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                     float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t gstride = K / 32 * a8_group_block_bytes(QT), nb = K / 32;
  // Q8_0: each row's integer sum of its activations per block (pair_dots' offset term), this thread's scratch.
  // quantize_act keeps only xd * sum, a float, for every path; re-deriving the integers here (M x K byte adds
  // per call) keeps its interface and the other paths as they are.
  thread_local std::vector<int32_t> sums;
  if (QT == Q8_0) {
    if (sums.size() < (size_t)(M * nb)) sums.resize(M * nb);
    for (int64_t rb = 0; rb < M * nb; rb++) {
      int32_t t = 0;
      for (int i = 0; i < 32; i++) t += xq[rb * 32 + i];
      sums[rb] = t;
    }
  }
  for (int64_t gi = g0; gi < g1; gi++) {
    const uint8_t* g = p + gi * gstride;
    if (gi + 1 < g1) {   // two groups at once
      const int valid = (int)std::min<int64_t>(16, N - 8 * gi);
      for (int64_t r = 0, n; r < M; r += n) {
        n = M - r == TR + 1 ? TR + 1 : std::min<int64_t>(TR, M - r);   // 9 rows: one tile, not 8 + 1
        const int8_t* xr = xq + r * K;
        const float *dr = xd + r * nb, *sr = xs + r * nb;
        const int32_t* zr = QT == Q8_0 ? sums.data() + r * nb : nullptr;
        float* yr = y + 8 * gi + r * N;
        switch (n) {
          case 9: pair_a8<QT, 9>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 8: pair_a8<QT, 8>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 7: pair_a8<QT, 7>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 6: pair_a8<QT, 6>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 5: pair_a8<QT, 5>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 4: pair_a8<QT, 4>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 3: pair_a8<QT, 3>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          case 2: pair_a8<QT, 2>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
          default: pair_a8<QT, 1>(g, gstride, xr, dr, sr, zr, K, yr, N, valid); break;
        }
      }
      gi++;
      continue;
    }
    vnni256::linear_groups_a8(QT, p, xq, xd, xs, M, K, y, N, gi, gi + 1);   // a last odd group: the same bits
  }
}

// The float-activation products of F32 weights here; the GGUF block types take the AVX2 path (their AVX-512
// path reads pack_a8's layout: quant_f_avx512.cpp, chosen in ops.cpp where the weight comes with it).
void linear_rows(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, float* y,
                 int64_t N, int64_t n0, int64_t n1, float* buf) {
  if (qtype == F32) return linear_rows_f32((const float*)w, x, M, K, y, N, n0, n1);
  avx2::linear_rows(qtype, w, row_bytes, x, M, K, y, N, n0, n1, buf);
}

void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  if (qtype == Q4_0) return groups_t<Q4_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  if (qtype == Q4_1) return groups_t<Q4_1>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  return groups_t<Q8_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
}

}  // namespace avx512
}  // namespace peagle_quant
