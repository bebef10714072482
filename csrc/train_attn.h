// The softmax of the drafters' training attention between its oneDNN products (peagle/train/train_attention.py),
// one pass per direction. Scores s [R, S] float32 (R = heads x T queries; row r is query r % T) under a [T, S]
// bool mask shared by every head (true = visible):
//   forward   m = max_{visible j} s_j * scale,  p_j = e^(s_j * scale - m) / sum_{visible i} e^(s_i * scale - m)
//             (hidden keys, and every key of a row with none visible: 0), written as float32 and bfloat16;
//   backward  ds_j = p_j (dp_j - sum_i p_i dp_i) * scale  (d loss / d raw score), written as bfloat16.
// No torch headers: train_attn_avx512.cpp is compiled for AVX-512; train_attn.cpp binds it.
#pragma once
#include <cstdint>

namespace peagle_tattn {

// Rows r0..r1-1 of s / p / p16 (contiguous [R, S]).
void softmax_fwd_avx512(const float* s, const bool* mask, int64_t T, int64_t S, float scale, int64_t r0, int64_t r1,
                        float* p, uint16_t* p16);
void softmax_bwd_avx512(const float* dp, const float* p, int64_t S, float scale, int64_t r0, int64_t r1,
                        uint16_t* ds);

}  // namespace peagle_tattn
