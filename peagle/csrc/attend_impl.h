// Attention whose every output depends only on its own query and the keys/values it may see, summed in one
// fixed order: batch- and block-invariant (a query gives the same bits alone, in a verify block of any length,
// in a tree, or next to other rows). Included by attend_generic.cpp and by attend_avx2.cpp (compiled for AVX2 +
// FMA, PEAGLE_ATTEND_AVX2: the lane loops below as intrinsics); both run the same IEEE operations in the same
// order (fma = one rounding; no contraction, no fast-math), so they agree bit for bit. hd: a multiple of 8.
//
// Per (row b, query t, head h): kv head g = h / (nh / nkv); over the visible keys j in ascending order:
//   s_j = fold8(q . k_j) * scale   (8 lane accumulators over hd, lane l adds elements 8i+l, folded 4+4, 2+2, 1+1)
//   m = max s_j;  p_j = exp_neg(s_j - m);  l = sum p_j in order;  o = sum p_j * v_j in order (lane-wise fma);
//   out = o * (1 / l)   (no visible key: zeros).
// exp_neg is peagle's own e^x for x <= 0 (Cephes' expf polynomial, ~1 ulp) from basic IEEE operations only, so
// 8 lanes at once and one at a time give the same bits (libm's expf would not vectorize, nor match a vector one).
// attend_avx512.cpp adds PEAGLE_ATTEND_AVX512: two queries' 8-lane dot products side by side in one zmm (each
// half the same fma chain), 16-lane e^x and value sums (elementwise: the same operations per element). The
// vector builds' blocked form (queries sharing a kv head meet each chunk of keys in L1) is attend_blocked.h.
#pragma once
#ifdef PEAGLE_ATTEND_AVX2
#include <immintrin.h>

#include "quant_avx2_inline.h"
#endif
#ifdef PEAGLE_ATTEND_AVX512
#include "exp16_inline.h"
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "exp1_inline.h"
#include "exp_consts.h"

namespace peagle_attend {

struct AttnArgs {
  const float* q;        // [B, T, nh, hd] contiguous
  const void* k;         // k[b, g, j, :] at k + b*ksb + g*ksg + j*ksj elements: float32, or bfloat16 (kv_bf16)
  const void* v;         // same strides and type as k
  const uint8_t* mask;   // nullptr: every key < S visible; else key j visible iff mask[b*msb + t*mst + j] != 0
  float* out;            // [B, T, nh * hd]
  int64_t B, T, nh, nkv, hd, S;
  int64_t ksb, ksg, ksj, msb, mst;
  float scale;
  bool kv_bf16;          // k and v hold bfloat16 words (a bfloat16 KV cache), widened exactly to float32 on load
};

// A cache element as float32: a float32 one as it is, a bfloat16 word widened exactly (its bits in the high half).
// Every kernel below reads k and v only through these, so a bfloat16 cache gives the bits a float32 cache holding
// the same (bfloat16-rounded) values gives.
using bf16w = uint16_t;
static inline float kv_at(const float* p, int64_t i) { return p[i]; }
static inline float kv_at(const bf16w* p, int64_t i) {
  const uint32_t u = (uint32_t)p[i] << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#ifdef PEAGLE_ATTEND_AVX2
static inline __m256 kv_ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 kv_ld8(const bf16w* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif
#ifdef PEAGLE_ATTEND_AVX512
static inline __m512 kv_ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 kv_ld16(const bf16w* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif

// e^x for x <= 0 (clamped below at -87: e^-87 ~ 1.6e-38, the smallest normal scale).
static inline float exp_neg(float x) { return peagle_exp::exp1_clamped(x > -87.0f ? x : -87.0f); }

#ifdef PEAGLE_ATTEND_AVX2
using peagle_quant::avx2::exp_neg8;   // the same operations on 8 lanes at once (quant_avx2_inline.h)
#endif
#ifdef PEAGLE_ATTEND_AVX512
using peagle_exp::exp_neg16;   // exp16_inline.h: exp8_clamped's operations lane by lane, on 16
#endif

// fold8(a . b) over n (a multiple of 8) elements: lane l accumulates elements 8i+l with fma, folded 4+4, 2+2, 1+1.
template <typename KV>
static inline float dot8(const float* a, const KV* b, int64_t n) {
#ifdef PEAGLE_ATTEND_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_ld8(b + i), acc);
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
#else
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i += 8)
    for (int l = 0; l < 8; l++) acc[l] = std::fma(a[i + l], kv_at(b, i + l), acc[l]);
  float v4[4];
  for (int l = 0; l < 4; l++) v4[l] = acc[l] + acc[l + 4];
  const float v20 = v4[0] + v4[2], v21 = v4[1] + v4[3];
  return v20 + v21;
#endif
}

// o[i] = fma(p, v[i], o[i]) for i < n (a multiple of 8).
template <typename KV>
static inline void axpy(float p, const KV* v, float* o, int64_t n) {
#ifdef PEAGLE_ATTEND_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, kv_ld8(v + i), _mm256_loadu_ps(o + i)));
#else
  for (int64_t i = 0; i < n; i++) o[i] = std::fma(p, kv_at(v, i), o[i]);
#endif
}

// s[c] = exp_neg(s[c] - m) for c < n.
static inline void exp_shifted(float* s, int64_t n, float m) {
  int64_t c = 0;
#ifdef PEAGLE_ATTEND_AVX512
  const __m512 mz = _mm512_set1_ps(m);
  for (; c + 16 <= n; c += 16) _mm512_storeu_ps(s + c, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + c), mz)));
#endif
#ifdef PEAGLE_ATTEND_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(s + c, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + c), mv)));
#endif
  for (; c < n; c++) s[c] = exp_neg(s[c] - m);
}

#ifdef PEAGLE_ATTEND_AVX2
// Four keys' dot8 at once (four independent accumulator chains; each key's operations exactly dot8's), times
// scale.
template <typename KV>
static inline void dot8x4(const float* q, const KV* k0, const KV* k1, const KV* k2, const KV* k3, int64_t n,
                          float scale, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, kv_ld8(k0 + i), a0);
    a1 = _mm256_fmadd_ps(qv, kv_ld8(k1 + i), a1);
    a2 = _mm256_fmadd_ps(qv, kv_ld8(k2 + i), a2);
    a3 = _mm256_fmadd_ps(qv, kv_ld8(k3 + i), a3);
  }
  const __m256 acc[4] = {a0, a1, a2, a3};
  for (int c = 0; c < 4; c++) {
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(acc[c]), _mm256_extractf128_ps(acc[c], 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    out[c] = _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1))) * scale;
  }
}
#endif

// Queries idx0..idx1-1 of the flattened (b, t, h) range.
template <typename KV>
static inline void attend_range_t(const AttnArgs& a, int64_t idx0, int64_t idx1) {
  std::vector<float> s(a.S), o(a.hd);
  std::vector<int32_t> vis(a.S);
  const int64_t group = a.nh / a.nkv;
  for (int64_t idx = idx0; idx < idx1; idx++) {
    const int64_t h = idx % a.nh, t = (idx / a.nh) % a.T, b = idx / (a.nh * a.T);
    const float* q = a.q + idx * a.hd;
    const int64_t g = h / group;
    const KV* kb = (const KV*)a.k + b * a.ksb + g * a.ksg;
    const KV* vb = (const KV*)a.v + b * a.ksb + g * a.ksg;
    const uint8_t* mrow = a.mask ? a.mask + b * a.msb + t * a.mst : nullptr;
    int64_t n = 0;
    for (int64_t j = 0; j < a.S; j++)
      if (!mrow || mrow[j]) vis[n++] = (int32_t)j;
    int64_t c = 0;
#ifdef PEAGLE_ATTEND_AVX2
    for (; c + 4 <= n; c += 4) {
      dot8x4(q, kb + vis[c] * a.ksj, kb + vis[c + 1] * a.ksj, kb + vis[c + 2] * a.ksj, kb + vis[c + 3] * a.ksj,
             a.hd, a.scale, &s[c]);
    }
#endif
    for (; c < n; c++) s[c] = dot8(q, kb + vis[c] * a.ksj, a.hd) * a.scale;
    float m = -INFINITY;
    for (c = 0; c < n; c++) m = s[c] > m ? s[c] : m;   // scores are finite: fmax's value, without its call
    float* dst = a.out + idx * a.hd;
    exp_shifted(s.data(), n, m);
    float l = 0.0f;
    for (c = 0; c < n; c++) l += s[c];
    for (int64_t i = 0; i < a.hd; i++) o[i] = 0.0f;
    for (c = 0; c < n; c++) axpy(s[c], vb + vis[c] * a.ksj, o.data(), a.hd);
    const float inv = n ? 1.0f / l : 0.0f;
    for (int64_t i = 0; i < a.hd; i++) dst[i] = o[i] * inv;
  }
}
static inline void attend_range(const AttnArgs& a, int64_t idx0, int64_t idx1) {
  if (a.kv_bf16) attend_range_t<bf16w>(a, idx0, idx1);
  else attend_range_t<float>(a, idx0, idx1);
}

}  // namespace peagle_attend

#ifdef PEAGLE_ATTEND_AVX2
#include "attend_blocked.h"
#endif
