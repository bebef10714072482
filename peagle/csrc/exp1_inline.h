// peagle's e^x one lane at a time: quant_avx2_inline.h's exp8_clamped operations on one float (Cephes' expf
// polynomial, ~1 ulp; x = n ln2 + r, 2^n built in the exponent bits; basic IEEE operations only, rounding in the
// current mode as the vector round does), so a scalar path gives the vector paths' bits. No target pragma needed.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "exp_consts.h"

namespace peagle_exp {

// e^x for x already clamped to [-87, 88].
static inline float exp1_clamped(float x) {
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(n, LN2_HI, x);
  r = std::fma(n, LN2_LO, r);
  float p = P0;
  p = std::fma(p, r, P1);
  p = std::fma(p, r, P2);
  p = std::fma(p, r, P3);
  p = std::fma(p, r, P4);
  p = std::fma(p, r, P5);
  p = std::fma(p * r, r, r) + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;              // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// e^x for any x: clamped to [-87, 88] as the vector exp8 clamps (max, then min: a NaN becomes -87).
static inline float exp1(float x) {
  x = x > -87.0f ? x : -87.0f;
  return exp1_clamped(x < 88.0f ? x : 88.0f);
}

}  // namespace peagle_exp
