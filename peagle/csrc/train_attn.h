// The softmax of the drafters' training attention between its products (peagle/train/train_attention.py), one
// pass per direction. Scores s [R, S] float32 (R = heads x T queries; row r is query r % T) under a [T, S]
// bool mask shared by every head (true = visible):
//   forward   m = max_{visible j} s_j * scale,  p_j = e^(s_j * scale - m) / sum_{visible i} e^(s_i * scale - m)
//             (hidden keys, and every key of a row with none visible: 0), written as bfloat16;
//   backward  ds_j = p_j (dp_j - sum_i p_i dp_i) * scale  (d loss / d raw score) from those bfloat16 p, written
//             as bfloat16 (P in bfloat16 is what the value product reads; ds is rounded to bfloat16 anyway).
// The products around them on AMX-BF16 tiles (train_scores_amx.cpp): the scores out [M, N] float32 = a [M, D]
// b [N, D]^T for bfloat16 a and b (D a multiple of 32), from b packed by pack_pairs; a strip of P (dS) times the
// values (keys) packed by pack_pairs_k.
// No torch headers: train_attn_avx512.cpp and train_scores_amx.cpp are compiled for AVX-512 / AMX;
// train_attn.cpp binds them.
#pragma once
#include <cstdint>

namespace peagle_tattn {

// n rows of s / p16 (pointers at the first, rows S apart), the first one query t0 of the mask; e: S floats of
// scratch.
void softmax_fwd_avx512(const float* s, const bool* mask, int64_t T, int64_t S, float scale, int64_t t0, int64_t n,
                        float* e, uint16_t* p16);
void softmax_bwd_avx512(const float* dp, const uint16_t* p16, int64_t S, float scale, int64_t n, uint16_t* ds);

// Keys rounded up to the tiles' 32 (the packed layouts' zero-padded length).
inline int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

// b [N, D] (b[j]: row j) -> out, round32(N) * D words.
void pack_pairs(const uint16_t* const* b, int64_t N, int64_t D, uint16_t* out);
// Rows m0..m1-1 of out (row stride ldo) from a (row stride lda) and the packed b.
void scores_amx(const uint16_t* a, int64_t lda, const uint16_t* bp, int64_t N, int64_t D, int64_t m0,
                       int64_t m1, float* out, int64_t ldo);

// b [K, N] (b[k]: row k, N a multiple of 32) -> out in pairs along K, Kp = K rounded up to 32 (zero rows):
// Kp * N words.
void pack_pairs_k(const uint16_t* const* b, int64_t K, int64_t N, uint16_t* out);
// out [nr, N] float32 (row stride ldo, nr <= 32) = a [32, Kp] bfloat16 (rows past nr and keys past K zero) times
// the b packed by pack_pairs_k.
void strip_times_amx(const uint16_t* a, int64_t Kp, int64_t nr, const uint16_t* bp, int64_t N, float* out,
                     int64_t ldo);

// Flush-to-zero and denormals-are-zero for this thread while in scope: a softmax's tails below float32's smallest
// normal (~1.2e-38) otherwise take the CPU's slow path on every operation (measured 3x slower softmax backward).
struct FlushDenormals {
  unsigned int saved;
  FlushDenormals();
  ~FlushDenormals();
};

}  // namespace peagle_tattn
