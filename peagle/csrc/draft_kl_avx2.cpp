// AVX2 + FMA + F16C path of the fused draft loss (draft_kl.h). No torch headers: this translation unit is
// compiled for AVX2 through the target pragma. Two passes over an element's logits forward (the max and its
// first index; then sum e^(z - m) and sum e^t (t - z)), one backward; 8-lane partial sums folded 4+4, 2+2, 1+1.
// e^x is peagle's Cephes polynomial (exp_neg8, ~1 ulp) on arguments clamped to [-87, 0].
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "draft_kl.h"
#include "quant_avx2_inline.h"

namespace peagle_kl {

namespace {

using peagle_quant::avx2::exp_neg8;
using peagle_quant::avx2::fold;

inline __m256 load8(const KLArgs& a, int64_t e, int64_t v) {
  if (a.bf16) {
    const uint16_t* p = (const uint16_t*)a.z + e * a.zs + v;
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));             // bfloat16 -> float32: exact
  }
  return _mm256_loadu_ps((const float*)a.z + e * a.zs + v);
}

inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// float32 -> bfloat16, rounded to nearest even (torch's rounding; a NaN: 0x7fc0, as torch), 8 lanes -> 8 words.
inline void store_bf16(uint16_t* p, __m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extractf128_si256(r, 1));
  _mm_storeu_si128((__m128i*)p, w);
}

}  // namespace

void forward_avx2(const KLArgs& a, int64_t e0, int64_t e1, float* kl, float* lse, int64_t* top) {
  const __m256i step = _mm256_set1_epi32(8);
  for (int64_t e = e0; e < e1; e++) {
    // the max, and per lane the first index reaching that lane's max; then the least such index overall
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    __m256i i8 = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t v = 0; v < a.V; v += 8, at = _mm256_add_epi32(at, step)) {
      const __m256 z = load8(a, e, v);
      const __m256 gt = _mm256_cmp_ps(z, m8, _CMP_GT_OQ);
      m8 = _mm256_blendv_ps(m8, z, gt);
      i8 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i8), _mm256_castsi256_ps(at), gt));
    }
    const float m = hmax(m8);
    alignas(32) float mv[8];
    alignas(32) int32_t iv[8];
    _mm256_store_ps(mv, m8);
    _mm256_store_si256((__m256i*)iv, i8);
    int64_t best = a.V;
    for (int l = 0; l < 8; l++)
      if (mv[l] == m && iv[l] < best) best = iv[l];
    top[e] = best < a.V ? best : 0;
    // sum e^(z - m) and sum e^t (t - z)
    const float* t = a.t + a.rows[e] * a.ts;
    const __m256 mz = _mm256_set1_ps(m);
    __m256 s8 = _mm256_setzero_ps(), k8 = _mm256_setzero_ps();
    for (int64_t v = 0; v < a.V; v += 8) {
      const __m256 z = load8(a, e, v), tv = _mm256_loadu_ps(t + v);
      s8 = _mm256_add_ps(s8, exp_neg8(_mm256_sub_ps(z, mz)));
      k8 = _mm256_fmadd_ps(exp_neg8(tv), _mm256_sub_ps(tv, z), k8);
    }
    lse[e] = m + std::log(fold(s8));
    kl[e] = fold(k8) + lse[e];
  }
}

void backward_avx2(const KLArgs& a, int64_t e0, int64_t e1, const float* lse, const float* g, void* grad) {
  for (int64_t e = e0; e < e1; e++) {
    const float* t = a.t + a.rows[e] * a.ts;
    const __m256 l8 = _mm256_set1_ps(lse[e]), g8 = _mm256_set1_ps(g[e]);
    for (int64_t v = 0; v < a.V; v += 8) {
      const __m256 d = _mm256_sub_ps(exp_neg8(_mm256_sub_ps(load8(a, e, v), l8)), exp_neg8(_mm256_loadu_ps(t + v)));
      const __m256 r = _mm256_mul_ps(d, g8);
      if (a.bf16) store_bf16((uint16_t*)grad + e * a.V + v, r);
      else _mm256_storeu_ps((float*)grad + e * a.V + v, r);
    }
  }
}

}  // namespace peagle_kl
