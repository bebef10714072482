// float32 -> bfloat16 rounded to nearest even on 16 lanes (a NaN: 0x7fc0, as torch), stored as raw 16-bit words. Included only by
// translation units compiled for AVX-512 F/BW (draft_kl_avx512.cpp, train_attn_avx512.cpp, transpose_avx512.cpp,
// train_ops_avx512.cpp).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace peagle_bf16 {

static inline void store_bf16(uint16_t* p, __m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));   // NaN: torch's
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}

// 16 lanes from raw bfloat16 words (widened exactly) or float32, at element i of p.
static inline __m512 load16(const void* p, bool bf16, int64_t i) {
  if (bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float*)p + i);
}

// 16 lanes to element i of p, as bfloat16 (rounded to nearest even) or float32.
static inline void store16(void* p, bool bf16, int64_t i, __m512 x) {
  if (bf16)
    store_bf16((uint16_t*)p + i, x);
  else
    _mm512_storeu_ps((float*)p + i, x);
}

// The low n (< 16) lanes only.
static inline void store_bf16_n(uint16_t* p, __m512 x, int64_t n) {
  alignas(64) uint16_t w[16];
  store_bf16(w, x);
  __builtin_memcpy(p, w, 2 * n);
}

}  // namespace peagle_bf16
