// AVX-512 path of the training attention's softmax (train_attn.h): per row, a max pass, an e^x pass that keeps the
// exponentials (in a row of scratch) and their lane sums, and a scaling pass that writes bfloat16. Lane sums reduced by
// _mm512_reduce_add_ps (a training op: the tests hold it to a float64 reference within tolerance). No torch headers.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bf16_inline.h"
#include "exp16_inline.h"
#include "train_attn.h"

namespace peagle_tattn {

namespace {

using peagle_bf16::store_bf16;
using peagle_exp::exp_neg16;

// Lanes j..j+15 that exist (j + lane < S).
inline __mmask16 tail16(int64_t j, int64_t S) {
  return S - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (S - j)) - 1);
}

// Those of them that are visible (mask byte non-zero).
inline __mmask16 visible16(const bool* m, int64_t j, int64_t S) {
  const __m128i b = _mm_maskz_loadu_epi8(tail16(j, S), m + j);
  return _mm_test_epi8_mask(b, b);
}

// bfloat16 words j..j+15 of q (lanes outside `in` zero), widened exactly.
inline __m512 load16_n(const uint16_t* q, int64_t j, __mmask16 in) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, q + j)), 16));
}

}  // namespace

FlushDenormals::FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }   // FTZ | DAZ
FlushDenormals::~FlushDenormals() { _mm_setcsr(saved); }

void softmax_fwd_avx512(const float* s, const bool* mask, int64_t T, int64_t S, float scale, int64_t t0, int64_t n,
                        float* e, uint16_t* p16) {
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < n; r++) {
    const float* x = s + r * S;
    const bool* m = mask + ((t0 + r) % T) * S;
    uint16_t* o16 = p16 + r * S;
    __m512 mx = ninf;
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 vis = visible16(m, j, S);
      mx = _mm512_mask_max_ps(mx, vis, mx, _mm512_mul_ps(_mm512_maskz_loadu_ps(vis, x + j), sc));
    }
    const float mmax = _mm512_reduce_max_ps(mx);
    if (mmax == -INFINITY) {                       // no visible key: zeros
      for (int64_t j = 0; j < S; j += 16) _mm256_mask_storeu_epi16(o16 + j, tail16(j, S), _mm256_setzero_si256());
      continue;
    }
    const __m512 mv = _mm512_set1_ps(mmax);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 vis = visible16(m, j, S);
      // x * sc rounded as in the max pass, so the maximum's exponent is exactly 0
      const __m512 xs = _mm512_mul_ps(_mm512_maskz_loadu_ps(vis, x + j), sc);
      const __m512 ex = _mm512_maskz_mov_ps(vis, exp_neg16(_mm512_sub_ps(xs, mv)));
      sum = _mm512_add_ps(sum, ex);
      _mm512_mask_storeu_ps(e + j, tail16(j, S), ex);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    int64_t j = 0;
    for (; j + 16 <= S; j += 16) store_bf16(o16 + j, _mm512_mul_ps(_mm512_loadu_ps(e + j), inv));
    if (j < S) {
      const __m512 x = _mm512_maskz_loadu_ps(tail16(j, S), e + j);
      peagle_bf16::store_bf16_n(o16 + j, _mm512_mul_ps(x, inv), S - j);
    }
  }
}

void softmax_bwd_avx512(const float* dp, const uint16_t* p16, int64_t S, float scale, int64_t n, uint16_t* ds) {
  for (int64_t r = 0; r < n; r++) {
    const float* g = dp + r * S;
    const uint16_t* q = p16 + r * S;
    uint16_t* o = ds + r * S;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 in = tail16(j, S);
      acc = _mm512_fmadd_ps(load16_n(q, j, in), _mm512_maskz_loadu_ps(in, g + j), acc);
    }
    const __m512 d = _mm512_set1_ps(_mm512_reduce_add_ps(acc)), sc = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= S; j += 16) {
      const __m512 gd = _mm512_sub_ps(_mm512_loadu_ps(g + j), d);
      store_bf16(o + j, _mm512_mul_ps(_mm512_mul_ps(load16_n(q, j, 0xffff), gd), sc));
    }
    if (j < S) {
      const __mmask16 in = tail16(j, S);
      const __m512 gd = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, g + j), d);
      peagle_bf16::store_bf16_n(o + j, _mm512_mul_ps(_mm512_mul_ps(load16_n(q, j, in), gd), sc), S - j);
    }
  }
}

}  // namespace peagle_tattn
