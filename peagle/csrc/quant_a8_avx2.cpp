// AVX2 path of the 8-bit-activation products (quant_a8_ymm.h: the kernel at ymm width). Q4: the 8 maddubs of a
// block are summed in 16 bits (|sum| <= 8 * 2 * 15 * 127 < 2^15: exact), then one madd by ones gives each output
// its block's integer dot product; Q8_0 (|w| up to 128) widens after every maddubs (sign trick: |w| unsigned,
// x * sign(w)). Also quantize_act, shared by every vector path.
#include <cfloat>      // before the target pragma: a standard header is not built for AVX2
#include <cstdint>
#include <cstring>
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "quant_a8_ymm.h"

namespace peagle_quant {
namespace avx2 {

struct MaddDot {
  static constexpr int accumulators(int) { return 1; }
  static inline void q4(__m256i& s, __m256i w, __m256i x) {
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x));
    __asm__("" : "+x"(s));   // summed in the order written: GCC reassociated the sums into trees that spilled
  }                          // registers from 2 rows on (the same integers either way)
  static inline void q8(__m256i& s, __m256i u, __m256i x) {
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
    __asm__("" : "+x"(s));   // as q4
  }
  template <int QT, int NA>
  static inline __m256i finish(const __m256i* s) {
    return QT == Q8_0 ? s[0] : _mm256_madd_epi16(s[0], _mm256_set1_epi16(1));
  }
};

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
  a8ymm::linear_groups<MaddDot>(qtype, packed, xq, xd, xs, M, K, y, N, g0, g1);
}

}  // namespace avx2
}  // namespace peagle_quant
