// peagle's weight-only quantized linear kernels: y[M, N] = x[M, K] @ W^T, W stored as GGUF blocks of 32
// (Q4_0, Q4_1, Q8_0, llama.cpp's byte layout) or as float32 (F32), x and y float32.
//
// F32 layout ("packed by 8"): the outputs in groups of 8 (the last padded with zero rows, so the tensor has
// ceil(N/8)*8 rows of 4K bytes), per group its K/8 chunks in order, per chunk the 8 outputs' 8 floats side by
// side: W[n, 8c + l] at float (n/8)*8K + 64c + 8(n%8) + l. A group's weights are one sequential stream (8 rows
// read side by side would be 8 streams: measured 15-25 % slower at one row on a 2-core AMD EPYC Zen 3).
//
// Batch invariance: y[r, n] depends only on x[r, :] and W[n, :], never on M, on r, or on which thread computes
// it. Per output channel the kernel dequantizes the row of W into float32 (Q4_0: d*(q-8), Q4_1: fma(d, q, m),
// Q8_0: d*q, d and m read exactly from fp16; F32 as stored), then every activation row takes the same dot product: 8 lane
// accumulators (lane l adds w[8i+l]*x[8i+l] for i = 0, 1, ... in order, each with one fused multiply-add),
// folded at the end in one fixed tree (4+4, 2+2, 1+1). The scalar path performs the
// same IEEE operations in the same order as the AVX2 path, so both give bit-identical results.
#pragma once
#include <cstdint>
#include <cstring>

namespace peagle_quant {

enum QType : int { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };   // GGML's type ids

constexpr int block_bytes(int qtype) {   // 0: no such type
  return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : qtype == F32 ? 128 : 0;
}
// Rows of a weight tensor of N outputs (F32: padded to a multiple of 8).
inline int64_t stored_rows(int qtype, int64_t N) { return qtype == F32 ? (N + 7) / 8 * 8 : N; }
// Float-activation products take their rows in blocks of this many (each block's activations stay in L2; the
// weights are read, and Q4 / Q8 blocks dequantized, once per block), so any row count runs the kernel -- one
// summation order per row whatever the call's row count (a verify block of B x (K+1) rows included); F32 at 128
// rows within ~10 % of oneDNN's GEMM on a 2-core Zen 3.
constexpr int64_t ROW_BLOCK = 128;

// Outputs n0..n1-1 of every row: y[r*N + n] = dot(x[r, :], W[n, :]). buf: 4*K floats of scratch.
using LinearFn = void (*)(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                          float* y, int64_t N, int64_t n0, int64_t n1, float* buf);

namespace scalar {
void linear_rows(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* buf);
void dequant_row(int qtype, const uint8_t* row, int64_t K, float* dst);
}  // namespace scalar
namespace avx2 {
// silu(a) * b elementwise with peagle's own vector e^x (batch-invariant: every element the same ops).
void silu_mul(const float* a, const float* b, float* o, int64_t n);
void linear_rows(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* buf);
}  // namespace avx2
namespace avx512 {   // F32 on zmm; the block types through avx2::linear_rows
void linear_rows(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* buf);
}  // namespace avx512


// ---- 8-bit activations (llama.cpp's arithmetic: GGUF weights times activations quantized to 8 bits) ----------
// Each activation row is quantized per block of 32 (quantize_act, shared by both paths): xd[b] = amax/127,
// xq = nearbyint(x * (1/xd)) in [-127, 127] (0 where xd < FLT_MIN: 1/xd would not be finite),
// xs[b] = xd[b] * sum(xq of the block). Per output and row, block b's
// integer dot product p_b (unsigned nibbles or signed Q8_0 weights times xq) is exact; then, blocks in order,
// acc = fma(d_w[b] * xd[b], (float)p_b, acc) (the product rounded once, then one fused multiply-add); Q4_1's
// minimum term (and Q4_0's, as m = -8 d) is summed apart over the blocks in order, s = fma(m_w[b], xs[b], s);
// y = acc + s (Q8_0: y = acc). Row-wise: batch-invariant.
void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs);

// The AVX2 path reads the weights repacked (pack_a8) so that a vector lane is an output (and so does the AVX-512
// path of the block types with float activations, quant_f_avx512.cpp): groups of 8 outputs
// (the last one padded with zero blocks), per group its blocks in order, per block ("group-block"): the 8
// outputs' fp16 d (16 B), Q4_1 their fp16 m (16 B), then the weights in rows of 32 bytes, row c holding bytes
// 4c..4c+3 of each output in turn (output o at bytes 4o..4o+3): Q4 4 rows of GGUF's nibble bytes (low nibble:
// weight j, high: weight j + 16), Q8_0 8 rows of its int8 weights. Same bytes as GGUF's blocks, reordered.
constexpr int a8_group_block_bytes(int qtype) {
  return qtype == Q4_0 ? 16 + 128 : qtype == Q4_1 ? 32 + 128 : 16 + 256;
}
// w [N, nb * block bytes] -> out [ceil(N/8), nb * a8_group_block_bytes].
void pack_a8(int qtype, const uint8_t* w, int64_t N, int64_t K, uint8_t* out);

// The F32 products' share of a row tile in prefetching the next group (the AVX2 and AVX-512 paths): tile `share` of
// `tiles` prefetches at steps share, share + tiles, share + 2 tiles, ... (due() once per step, in order).
struct PrefetchShare {
  int64_t countdown, tiles;
  bool due() {
    const bool now = countdown == 0;
    countdown = (now ? tiles : countdown) - 1;
    return now;
  }
};

// The a8 paths prefetch, block by block, the same block of the group this many groups ahead (a thread's groups are
// one stream, so that is where it reads next; a prefetch past the weight's end never faults). Measured on a 2-core
// Intel Xeon (KVM, AVX-512), SmolLM2 q4a8 decoding: plain step 3.58 -> 2.93 ms, a 2-row verify step 4.9 -> 3.2 ms
// (the hardware prefetcher alone did not keep the ~150 short streams of a step at the memory's bandwidth).
constexpr int64_t A8_PREFETCH_GROUPS = 2;

// 4 activation bytes as one 32-bit word (the 8-bit kernels broadcast it to every lane).
static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The `bytes` of the block at blk in the `groups` groups (1, or 2 for a pair) A8_PREFETCH_GROUPS groups of gs bytes
// further on, into L1. A hint into L2 on the AVX-512 and AMX paths measured no different on a 2-core Intel Xeon
// (docs/benchmarks/kernel-ab-avx512-xeon.md). static: each translation unit keeps its own copy, built for its own
// target pragma.
static inline void prefetch_ahead(const uint8_t* blk, int64_t gs, int bytes, int groups) {
  for (int i = 0; i < groups; i++)
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(blk + (A8_PREFETCH_GROUPS + i) * gs + off, 0, 3);
}

namespace scalar {
// Outputs n0..n1-1 of every row, from GGUF's blocks (w, row_bytes apart).
void linear_rows_a8(int qtype, const uint8_t* w, int64_t row_bytes, const int8_t* xq, const float* xd,
                    const float* xs, int64_t M, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1);
}  // namespace scalar
namespace avx2 {
void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs);
// Groups g0..g1-1 (outputs 8 g0 .. min(8 g1, N) - 1) of every row, from pack_a8's layout.
void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1);
}  // namespace avx2
namespace vnni256 {   // the AVX2 path's kernel with dpbusd on ymm (AVX-512 VL + VNNI; same bits)
void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1);
}  // namespace vnni256
namespace avx512 {   // the same through VNNI's dpbusd (same bits)
void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1);
}  // namespace avx512
namespace avx512f {   // the block types with float activations from pack_a8's layout (the scalar path's bits)
// Groups g0..g1-1 (outputs 8 g0 .. min(8 g1, N) - 1) of every row: y = x @ W^T, W dequantized exactly.
void linear_groups_f(int qtype, const uint8_t* packed, const float* x, int64_t M, int64_t K, float* y, int64_t N,
                     int64_t g0, int64_t g1);
}  // namespace avx512f
namespace amx {   // the same with each block's integer dots on the tile unit (AMX-INT8; same bits)
bool available();   // the CPU has it, the OS grants it to this process, and a probe product is right
// EDX of CPUID leaf 7, subleaf 0: the AMX feature bits (22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8).
inline unsigned cpuid7_edx() {
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return d;
}
void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1);
}  // namespace amx

}  // namespace peagle_quant
