// The drafter heads' RMSNorm and SwiGLU in bfloat16 training (peagle/train/train_ops.py), one pass each way, float32
// arithmetic. Rows of H (or I) elements, H and I multiples of 16; "bf16" arguments say whether a row buffer holds
// bfloat16 (raw 16-bit words) or float32. No torch headers: train_ops_avx512.cpp is compiled for AVX-512;
// train_ops.cpp binds it.
//   rms_norm  y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)              (y bfloat16, r kept per row)
//             dx = r * (g*w) - x * r^3 * mean(g*w*x),  dw += g * x * r    (dx in x's dtype, dw float32)
//   swiglu    h = silu(a) * b = a * sig(a) * b                             (bfloat16 in and out)
//             da = dh * b * sig(a) * (1 + a * (1 - sig(a))),  db = dh * a * sig(a)
#pragma once
#include <cstdint>

namespace peagle_tops {

// Rows r0..r1-1 of x [R, H] -> y [R, H] bfloat16 and r [R].
void rms_norm_fwd_avx512(const void* x, bool x_bf16, const float* w, float eps, int64_t H, int64_t r0, int64_t r1,
                         uint16_t* y, float* r);
// Rows r0..r1-1: dx [R, H] (x's dtype) written, dw [H] accumulated (the caller gives each thread its own).
void rms_norm_bwd_avx512(const void* x, bool x_bf16, const float* w, const float* r, const void* g, bool g_bf16,
                         int64_t H, int64_t r0, int64_t r1, void* dx, float* dw);
// Rows r0..r1-1 of a [R, I] (row stride lda) and b (stride ldb), bfloat16 -> h [R, I] bfloat16 contiguous.
void swiglu_fwd_avx512(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t I, int64_t r0,
                       int64_t r1, uint16_t* h);
// Rows r0..r1-1: dh [R, I] bfloat16 contiguous -> da, db [R, I] bfloat16 contiguous.
void swiglu_bwd_avx512(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, const uint16_t* dh, int64_t I,
                       int64_t r0, int64_t r1, uint16_t* da, uint16_t* db);

}  // namespace peagle_tops
