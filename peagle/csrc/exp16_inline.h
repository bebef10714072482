// peagle's e^x for x <= 0 on 16 lanes (clamped below at -87): quant_avx2_inline.h's exp8_clamped operations lane by
// lane (roundscale 0 = round to integer in the current mode), so every width gives the same bits per element.
// Included only by translation units compiled for AVX-512 (attend_avx512.cpp through attend_impl.h,
// draft_kl_avx512.cpp).
#pragma once
#include <immintrin.h>

#include "exp_consts.h"

namespace peagle_exp {

static inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_CUR_DIRECTION);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace peagle_exp
