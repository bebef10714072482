// Inline helpers of the AVX2 translation units (each compiled with #pragma GCC target("avx2,fma,f16c") before
// including this header; nothing else may include it).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

}  // namespace avx2
}  // namespace peagle_quant
