// The constants of peagle's e^x (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, 2^n in the exponent
// bits), shared by its scalar (attend_impl.h exp_neg), 8-lane (quant_avx2_inline.h exp8_clamped) and 16-lane
// (attend_impl.h exp_neg16) forms: the three give the same bits only with the same constants. Values only, no
// code, so any translation unit may include it whatever its target pragma.
#pragma once

namespace peagle_exp {
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = -0.693359375f;        // -ln2 in two parts: r = fma(n, LN2_HI, x), then fma(n, LN2_LO, r)
constexpr float LN2_LO = 2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;
}  // namespace peagle_exp
