// A transposing copy for the drafters' bfloat16 training products (peagle/train/train_linear.py): oneDNN's
// bfloat16 products run 2-3x slower with a transposed left operand, so a weight gradient g^T x is computed from a
// row-major copy of g^T (or x^T) written by this pass. No torch headers: transpose_avx512.cpp is compiled for
// AVX-512; transpose.cpp binds it.
#pragma once
#include <cstdint>

namespace peagle_transpose {

// dst[c, r] = src[r, c] for r < R, 0 for R <= r < ldd (dst [C, ldd], ldd a multiple of 16 >= R), columns
// c0..c1-1 (multiples of 16; C a multiple of 16). src and dst each float32 or bfloat16 (raw 16-bit words,
// rounded to nearest even when written from float32).
void transpose_avx512(const void* src, bool src_bf16, int64_t R, int64_t C, void* dst, bool dst_bf16, int64_t ldd,
                      int64_t c0, int64_t c1);

}  // namespace peagle_transpose
