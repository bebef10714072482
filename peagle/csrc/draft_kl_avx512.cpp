// AVX-512 path of the fused draft loss (draft_kl.h): draft_kl_avx2.cpp's passes on 16 lanes (chosen at run time
// where the CPU has AVX-512 F/BW/VL/DQ). Partial sums per lane, reduced by _mm512_reduce_add_ps: not the AVX2
// path's bits (a training loss; both match the op-by-op form within the tests' tolerance). No torch headers.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "draft_kl.h"
#include "bf16_inline.h"
#include "exp16_inline.h"

namespace peagle_kl {

namespace {

inline __m512 load16(const KLArgs& a, int64_t e, int64_t v) {
  if (a.bf16) {
    const uint16_t* p = (const uint16_t*)a.z + e * a.zs + v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  return _mm512_loadu_ps((const float*)a.z + e * a.zs + v);
}

// The 8 logits at v..v+7 in the low half, the high half zero (the tail where V is not a multiple of 16).
inline __m512 load_lo8(const KLArgs& a, int64_t e, int64_t v) {
  const __mmask16 lo = 0x00ff;
  if (a.bf16) {
    const uint16_t* p = (const uint16_t*)a.z + e * a.zs + v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(lo, _mm256_maskz_loadu_epi16(lo, p)), 16));
  }
  return _mm512_maskz_loadu_ps(lo, (const float*)a.z + e * a.zs + v);
}

using peagle_exp::exp_neg16;   // e^x on [-87, 0], clamped below (exp16_inline.h)

using peagle_bf16::store_bf16;     // rounded to nearest even (bf16_inline.h)

}  // namespace

void forward_avx512(const KLArgs& a, int64_t e0, int64_t e1, float* kl, float* lse, int64_t* top) {
  for (int64_t e = e0; e < e1; e++) {
    // V a multiple of 8: 16 lanes, then one masked half vector
    const int64_t V16 = a.V / 16 * 16;
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    __m512i i16 = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    int64_t v = 0;
    for (; v < V16; v += 16, at = _mm512_add_epi32(at, step)) {
      const __m512 z = load16(a, e, v);
      const __mmask16 gt = _mm512_cmp_ps_mask(z, m16, _CMP_GT_OQ);
      m16 = _mm512_mask_mov_ps(m16, gt, z);
      i16 = _mm512_mask_mov_epi32(i16, gt, at);
    }
    float m = _mm512_reduce_max_ps(m16);
    const __mmask16 hit = _mm512_cmp_ps_mask(m16, _mm512_set1_ps(m), _CMP_EQ_OQ);
    int64_t best = hit ? _mm512_mask_reduce_min_epi32(hit, i16) : a.V;
    for (int64_t w = v; w < a.V; w++) {         // the last 8 (V not a multiple of 16)
      const uint16_t* zb = (const uint16_t*)a.z + e * a.zs;
      float x;
      if (a.bf16) {
        const uint32_t bits = (uint32_t)zb[w] << 16;
        __builtin_memcpy(&x, &bits, 4);
      } else {
        x = ((const float*)a.z)[e * a.zs + w];
      }
      if (x > m) m = x, best = w;
    }
    top[e] = best < a.V ? best : 0;
    const float* t = a.t + a.rows[e] * a.ts;
    const __m512 mz = _mm512_set1_ps(m);
    __m512 s16 = _mm512_setzero_ps(), k16 = _mm512_setzero_ps();
    for (v = 0; v < V16; v += 16) {
      const __m512 z = load16(a, e, v), tv = _mm512_loadu_ps(t + v);
      s16 = _mm512_add_ps(s16, exp_neg16(_mm512_sub_ps(z, mz)));
      k16 = _mm512_fmadd_ps(exp_neg16(tv), _mm512_sub_ps(tv, z), k16);
    }
    if (v < a.V) {                               // 8 left: the low half, the high half masked to zero
      const __mmask16 lo = 0x00ff;
      const __m512 z = load_lo8(a, e, v);
      const __m512 tv = _mm512_maskz_loadu_ps(lo, t + v);
      s16 = _mm512_mask_add_ps(s16, lo, s16, exp_neg16(_mm512_sub_ps(z, mz)));
      k16 = _mm512_mask3_fmadd_ps(exp_neg16(tv), _mm512_sub_ps(tv, z), k16, lo);
    }
    lse[e] = m + std::log(_mm512_reduce_add_ps(s16));
    kl[e] = _mm512_reduce_add_ps(k16) + lse[e];
  }
}

void backward_avx512(const KLArgs& a, int64_t e0, int64_t e1, const float* lse, const float* g, void* grad) {
  for (int64_t e = e0; e < e1; e++) {
    const float* t = a.t + a.rows[e] * a.ts;
    const __m512 l16 = _mm512_set1_ps(lse[e]), g16 = _mm512_set1_ps(g[e]);
    int64_t v = 0;
    for (; v + 16 <= a.V; v += 16) {
      const __m512 d = _mm512_sub_ps(exp_neg16(_mm512_sub_ps(load16(a, e, v), l16)),
                                     exp_neg16(_mm512_loadu_ps(t + v)));
      const __m512 r = _mm512_mul_ps(d, g16);
      if (a.bf16) store_bf16((uint16_t*)grad + e * a.V + v, r);
      else _mm512_storeu_ps((float*)grad + e * a.V + v, r);
    }
    if (v < a.V) {                               // the last 8
      const __mmask16 lo = 0x00ff;
      const __m512 z = load_lo8(a, e, v);
      const __m512 r = _mm512_mul_ps(_mm512_sub_ps(exp_neg16(_mm512_sub_ps(z, l16)),
                                                   exp_neg16(_mm512_maskz_loadu_ps(lo, t + v))), g16);
      if (a.bf16) {
        peagle_bf16::store_bf16_n((uint16_t*)grad + e * a.V + v, r, 8);
      } else {
        _mm512_mask_storeu_ps((float*)grad + e * a.V + v, lo, r);
      }
    }
  }
}

}  // namespace peagle_kl
