// Inline helpers of the AVX2 translation units (each compiled with #pragma GCC target("avx2,fma,f16c") before
// including this header; nothing else may include it).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "exp_consts.h"

namespace peagle_quant {
namespace avx2 {

static inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 8 lanes of one accumulator folded in a fixed tree: 4+4, 2+2, 1+1 (as the scalar path).
static inline float fold(__m256 s) {
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  const __m128 v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
  return _mm_cvtss_f32(v1);
}

// e^x for x already clamped to [-87, 88]: Cephes' expf polynomial (~1 ulp), x = n ln2 + r, 2^n built in the
// exponent bits; basic IEEE operations only (the rounding: the current mode's, as nearbyint's), so a one-lane
// version of the same operations gives the same bits (exp1_inline.h).
static inline __m256 exp8_clamped(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(peagle_exp::LOG2E)),
                                   _MM_FROUND_CUR_DIRECTION);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(peagle_exp::LN2_HI), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(peagle_exp::LN2_LO), r);
  __m256 p = _mm256_set1_ps(peagle_exp::P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(peagle_exp::P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(peagle_exp::P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(peagle_exp::P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(peagle_exp::P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(peagle_exp::P5));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// e^x for x <= 0 (clamped below at -87: e^-87 ~ 1.6e-38, the smallest normal scale): the exact attention's and
// the draft loss's 8-lane e^x (attend_impl.h's exp_neg lane by lane).
static inline __m256 exp_neg8(__m256 x) { return exp8_clamped(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

}  // namespace avx2
}  // namespace peagle_quant
