// float32 -> bfloat16 rounded to nearest even on 16 lanes, stored as raw 16-bit words. Included only by
// translation units compiled for AVX-512 F/BW (draft_kl_avx512.cpp, train_attn_avx512.cpp).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace peagle_bf16 {

static inline void store_bf16(uint16_t* p, __m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}

// The low n (< 16) lanes only.
static inline void store_bf16_n(uint16_t* p, __m512 x, int64_t n) {
  alignas(64) uint16_t w[16];
  store_bf16(w, x);
  __builtin_memcpy(p, w, 2 * n);
}

}  // namespace peagle_bf16
