// peagle's CPU ops on raw float32 buffers, each parallelised over its independent outputs (at::parallel_for):
// the quantized products (quant_kernels.h), the fused small ops and the exact attention (attend_impl.h). The
// Python bindings (quant.cpp) and the whole-forward runner (forward.cpp) call the same functions, so a token
// gets the same bits whichever of them runs it. impl: 0 = best for this CPU, 1 = scalar / generic, 2 = AVX2, 3 =
// AVX-512 (the F32 and 8-bit-activation products on AVX-512 + VNNI, and the block types' float-activation ones
// given pack_a8's layout, up to 64 rows; AVX2 elsewhere), 4 = AMX (impl 3 with the 8-bit-activation products'
// integer dots on the tile unit); every path gives the same bits.
#pragma once
#include <cstdint>

#include "attend_impl.h"

namespace peagle_ops {

bool has_avx2();
bool has_avx512();             // AVX-512 F, VL, BW, DQ and VNNI (and AVX2)
bool has_amx();                // AMX-TILE + AMX-INT8 usable by this process (and AVX-512)
bool has_amx_bf16();           // and AMX-BF16 (the training attention's scores)
bool use_avx2(int64_t impl);   // impl 2, 3 or 4 without the CPU's support raises
bool use_avx512(int64_t impl);
// The 8-bit-activation products of M rows on the tile unit: impl 4 always, impl 0 from AMX_MIN_ROWS rows.
bool use_amx(int64_t impl, int64_t M);
// Measured on a 2-core Intel Xeon (KVM), every product of a SmolLM2 step, both paths prefetching, warm
// (lab/measure/kernel_paths.py, docs/benchmarks/kernel-paths.md): AVX-512 / AMX q4a8 0.93x at 8 rows, 1.08x at
// 16, 1.10x at 32; q8a8 1.00x at 8, 1.26x at 16, 1.37x at 32.
constexpr int64_t AMX_MIN_ROWS = 16;
// impl 0's choice between the AVX2 and AVX-512 paths for a product of M rows: AVX-512 from avx512_min_rows rows,
// one threshold per weight type (F32, Q4_0, Q4_1, Q8_0) and activation kind (float or 8-bit). The widest path
// does not win everywhere (a 2-core AMD EPYC with AVX-512, Zen 4: the AVX2 path's 1-row q4a8 products, in their maddubs form, 0.71x the
// AVX-512 one's time, lab/measure/kernel_paths.py), so peagle/models/kernel_choice.py measures the thresholds on
// the CPU at hand and sets them; 1 (AVX-512 at every row count, where the CPU has it) until set. Every path gives
// the same bits, so the choice changes only the time.
void set_avx512_min_rows(int qtype, bool act8, int64_t rows);
int64_t avx512_min_rows(int qtype, bool act8);
// The AVX2 path's (impl 2's) 8-bit-activation products through dpbusd on ymm (quant_a8_vnni256.cpp) where the
// CPU has AVX-512 VNNI, unless switched off (tests: the maddubs form on such a CPU); the same bits either way.
void set_avx2_vnni(bool on);
bool avx2_vnni();
// The path a product of M rows takes: impl as given, except impl 0 on an AVX-512 CPU below its threshold (2).
int64_t product_impl(int64_t impl, int qtype, bool act8, int64_t M);

// y[M, N] = x[M, K] @ W^T, W GGUF blocks [N, K/32 * block bytes] (weight-only: float activations) or F32 packed
// by 8. packed (block types; may be null): pack_a8 of w, which the AVX-512 path reads (without it that path's
// block-type products take the AVX2 one); same bits either way.
void qlinear(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint8_t* packed, int qtype, int64_t N,
             int64_t impl, float* y);

// Scratch of the 8-bit activations of M rows of K features (quant_kernels.h: quantize_act).
struct Act8 {
  int8_t* xq;   // [M * K]
  float* xd;    // [M * K/32]
  float* xs;    // [M * K/32]
};
// y = q8(x) @ W^T: the scalar path reads w (GGUF's blocks), the AVX2 one packed (pack_a8 of w); same bits.
void qlinear_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint8_t* packed, int qtype, int64_t N,
                int64_t impl, Act8 s, float* y);

// The row-wise small ops (quantize_act, the norms, silu_mul) split their rows over threads from SMALL_OP_ROWS + 1
// rows (at::parallel_for's grain: 9 rows run as 5 + 4; each row's operations are the same whoever computes it).
// Measured on a 2-core Intel Xeon (KVM), a SmolLM2 q4a8 forward of 17 / 33 rows in one process against all of
// them on one thread: 4.4 % / 4.8 % faster; at 5-9 rows no gain (a fork costs ~1 us, a row of them ~2 us). Before,
// quantize_act always ran on one thread, the norms up to 64 rows and silu_mul up to 16, the other thread waiting.
constexpr int64_t SMALL_OP_ROWS = 8;

// res = x + h, out = rms_norm(res) * w, R rows of H (res may be x itself).
void add_rms_norm(const float* x, const float* h, const float* w, int64_t R, int64_t H, float eps, float* res,
                  float* out);
// out = rms_norm(x) * w, R rows of H (the sums of squares as add_rms_norm's).
void rms_norm(const float* x, const float* w, int64_t R, int64_t H, float eps, float* out);
// out[r, :I] = silu(gu[r, :I]) * gu[r, I:], R rows of gu [2I].
void silu_mul(const float* gu, int64_t R, int64_t I, float* out, int64_t impl = 0);

// RoPE of q and k (rotate-half) and the k/v cache write. qkv [B*T, (nh + 2 nkv) * hd]; cos, sin [B*T, hd];
// pos [B*T] (< cap, checked by the caller); kc, vc [rows, nkv, cap, hd], float32 or (bf16) bfloat16 words, each
// value rounded to nearest even from the float32 one (torch's conversion); q out [B*T, nh, hd].
void rope_kv(const float* qkv, const float* cos, const float* sin, const int64_t* pos, int64_t B, int64_t T,
             int64_t nh, int64_t nkv, int64_t hd, void* kc, void* vc, bool bf16, int64_t cap, int64_t b0, float* q);

// Per row b < B (cache row b0 + b) and every kv head: the entries at slots start[b] + path[b, i] moved to
// start[b] + i, i < W (a row's W sources are read before its writes). k, v: one layer's [rows, nkv, cap, hd] of
// elements esize bytes wide.
void compact_kv(char* k, char* v, int64_t esize, int64_t nkv, int64_t cap, int64_t hd, int64_t b0, int64_t B,
                const int64_t* start, const int64_t* path, int64_t W);

// attend_impl.h over all of a's queries.
void attend(const peagle_attend::AttnArgs& a, int64_t impl);

}  // namespace peagle_ops
