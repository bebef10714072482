// AVX2 path of the 8-bit-activation products on the packed layout (quant_kernels.h: the arithmetic and the
// layout; quant_scalar.cpp: the same operations one output at a time on GGUF's own blocks). A vector lane is an
// output: in a group-block, 4 weight bytes of each of 8 outputs share one 32-byte row, so one maddubs against
// 4 activation bytes broadcast to every lane gives each output its own pair sums. Q4: the 8 maddubs of a block
// are summed in 16 bits (|sum| <= 8 * 2 * 15 * 127 < 2^15: exact), then one madd by ones gives each output
// its block's integer dot product; Q8_0 (|w| up to 128) widens after every maddubs (sign trick: |w| unsigned,
// x * sign(w)). Then per block one conversion and one fused multiply-add by d_w * xd for all 8 outputs.
#include <cfloat>      // before the target pragma: a standard header is not built for AVX2
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cstring>

#include "quant_avx2_inline.h"
#include "quant_kernels.h"

namespace peagle_quant {
namespace avx2 {

static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

static inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// Every output's integer dot product with NR rows (32 activation bytes each, K apart) over one group-block's
// weights qs: dots[r] lane o = output o's block sum for row r (each weight vector unpacked once for all rows).
template <int QT, int NR>
static inline void block_dots(const uint8_t* qs, const int8_t* x, int64_t K, __m256i* dots) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s[NR];
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) s[r] = _mm256_setzero_si256();
  if constexpr (QT == Q8_0) {
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * c)), u = _mm256_sign_epi8(w, w);
      #pragma GCC unroll 4
      for (int r = 0; r < NR; r++) {
        const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast4(x + r * K + 4 * c), w));
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) dots[r] = s[r];
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
      #pragma GCC unroll 4
      for (int r = 0; r < NR; r++) {
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, bcast4(x + r * K + 4 * c)));
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, bcast4(x + r * K + 16 + 4 * c)));
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) dots[r] = _mm256_madd_epi16(s[r], ones);
  }
}

// One group (8 outputs) x NR rows (K apart in xq, nb apart in xd / xs); writes the first `valid` outputs.
template <int QT, int NR>
static inline void group(const uint8_t* g, int64_t gs, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                         float* y, int64_t N, int valid) {
  constexpr int gb = a8_group_block_bytes(QT), qoff = QT == Q4_1 ? 32 : 16;
  const int64_t nb = K / 32;
  __m256 acc[NR];
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * gb;
    prefetch_ahead(blk, gs, gb, 1);   // gs: the groups' byte distance
    const __m256 d = halves8(blk);
    __m256i dots[NR];
    block_dots<QT, NR>(blk + qoff, xq + b * 32, K, dots);
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
      const __m256 dd = _mm256_mul_ps(d, _mm256_broadcast_ss(xd + r * nb + b));
      acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dots[r]), acc[r]);
    }
  }
  // the minimum terms (Q4_1's m, Q4_0's -8 d): per output and row one chain of fma in block order
  __m256 s[NR];
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) s[r] = _mm256_setzero_ps();
  if constexpr (QT != Q8_0) {
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = g + b * gb;
      const __m256 m = QT == Q4_1 ? halves8(blk + 16) : _mm256_mul_ps(halves8(blk), _mm256_set1_ps(-8.0f));
      #pragma GCC unroll 4
      for (int r = 0; r < NR; r++) s[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + r * nb + b), s[r]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < NR; r++) {
    alignas(32) float out[8];
    _mm256_store_ps(out, QT == Q8_0 ? acc[r] : _mm256_add_ps(acc[r], s[r]));
    for (int o = 0; o < valid; o++) y[r * N + o] = out[o];
  }
}

// Groups g0..g1-1 of all M rows, rows in tiles of up to 4 (each group-block's weights meet 4 rows per read).
template <int QT>
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
      if (nr == 4) group<QT, 4>(g, gstride, xr, dr, sr, K, yr, N, valid);
      else if (nr == 3) group<QT, 3>(g, gstride, xr, dr, sr, K, yr, N, valid);
      else if (nr == 2) group<QT, 2>(g, gstride, xr, dr, sr, K, yr, N, valid);
      else group<QT, 1>(g, gstride, xr, dr, sr, K, yr, N, valid);
    }
  }
}

// quantize_act's operations 8 lanes at a time (the same bits: max and min are exact, the rounding is the
// current mode's as nearbyint's; a NaN element falls out of amax and clamps to 127 as fmax / fmin make it).
void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (int64_t r = 0; r < M; r++)
    for (int64_t b = 0; b < nb; b++) {
      const float* v = x + r * K + b * 32;
      __m256 xv[4], am = _mm256_setzero_ps();
      for (int c = 0; c < 4; c++) {
        xv[c] = _mm256_loadu_ps(v + 8 * c);
        am = _mm256_max_ps(_mm256_andnot_ps(sign, xv[c]), am);
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      const float d = amax / 127.0f, id = d >= FLT_MIN ? 1.0f / d : 0.0f;   // 1/d finite; a smaller d: all zeros
      const __m256 idv = _mm256_set1_ps(id);
      __m256i q32[4];
      for (int c = 0; c < 4; c++) {
        const __m256 t = _mm256_round_ps(_mm256_mul_ps(xv[c], idv), _MM_FROUND_CUR_DIRECTION);
        q32[c] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(t, hi), lo));
      }
      // 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes: one permute restores the order)
      const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(xq + r * K + b * 32), q8);
      const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]), _mm256_add_epi32(q32[2], q32[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      xd[r * nb + b] = d;
      xs[r * nb + b] = d * (float)_mm_cvtsi128_si32(s4);
    }
}

void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  if (qtype == Q4_0) return groups_t<Q4_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  if (qtype == Q4_1) return groups_t<Q4_1>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  return groups_t<Q8_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
}

}  // namespace avx2
}  // namespace peagle_quant
