// AVX-512 path of the GGUF block types with float activations (q4 / q8: Q4_0, Q4_1, Q8_0 times float32 rows),
// reading pack_a8's layout (quant_kernels.h), where a vector lane is an output: a zmm holds one weight position k
// of a pair of groups (16 outputs). Per output the arithmetic is the scalar path's (quant_scalar.cpp): each weight
// dequantized alone (Q4_1 fma(d, q, m), Q4_0 d * (q - 8), Q8_0 d * q, d and m exact from fp16), 8 accumulators by
// k mod 8, each taking its weights in ascending k with one fused multiply-add, folded 4+4, 2+2, 1+1 -- so the same
// bits as every other path, at any row count.
//
// Why this layout: the GGUF-order paths dequantize a block of one output into 4 vectors of 8 weights (~20
// operations per 32 weights and row on the AVX2 path, shuffles for two outputs per zmm); here a weight position of
// 16 outputs is a nibble per 32-bit lane, so a Q4 weight vector costs a byte shuffle (vpshufb: the lane's byte t
// to its low byte; the high nibbles from one shift per block) and a 16-entry table lookup (vpermps reads only the
// index's low 4 bits) before its dequantizing FMA. Measured on a 2-core Intel Xeon (KVM; AVX-512), every product
// of a SmolLM2 q4 step (120 Q4_1, the Q8_0 LM head) against the GGUF-order paths, 2 threads, side by side
// (lab/measure/kernel_ab.py): 1 / 2 / 4 / 8 / 16 rows 12.2 / 13.8 / 16.4 / 18.9 / 32.9 -> 5.9 / 6.5 / 10.6 / 16.7
// / 31.3 ms, the same bits. At 8+ rows the products are bound by their FMAs (each weight
// vector's one per row), so the gain shrinks there. No torch headers.
#include <algorithm>   // the standard headers before the target pragma: none of their code is built for AVX-512
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#include "quant_avx512_inline.h"
#include "quant_kernels.h"

namespace peagle_quant {
namespace avx512f {

using avx512::halves16;

// Row c of a group-block (32 bytes: 4 weight bytes per output) of both groups of a pair as one zmm.
static inline __m512i rows16(const uint8_t* p, int64_t gs) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                            _mm256_loadu_si256((const __m256i*)(p + gs)), 1);
}

// The 32 weight vectors of one block of a pair (k = 0..31, 16 outputs each), handed to use(k, w) in ascending k.
// Q4: byte 4c + t of an output holds weights 4c + t (low nibble) and 4c + t + 16 (high), row c of the packed block.
template <int QT, typename Use>
static inline __attribute__((always_inline)) void block_weights(const uint8_t* blk, int64_t gs, Use use) {
  constexpr int qoff = QT == Q4_1 ? 32 : 16;
  const __m512 d = halves16(blk, gs);
  const uint8_t* q = blk + qoff;
  if constexpr (QT == Q8_0) {
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      const __m512i raw = rows16(q + 32 * c, gs);
      #pragma GCC unroll 4
      for (int t = 0; t < 4; t++) {   // the lane's byte t, sign-extended
        const __m512i v = t == 3 ? _mm512_srai_epi32(raw, 24) : _mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * t), 24);
        use(4 * c + t, _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
      }
    }
  } else {
    const __m512 tab = QT == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 m = QT == Q4_1 ? halves16(blk + 16, gs) : _mm512_setzero_ps();
    __m512i lo[4], hi[4];
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      lo[c] = rows16(q + 32 * c, gs);
      hi[c] = _mm512_srli_epi32(lo[c], 4);
    }
    #pragma GCC unroll 32
    for (int k = 0; k < 32; k++) {
      const int c = (k % 16) / 4, t = k % 4;
      const __m512i src = k < 16 ? lo[c] : hi[c];
      // byte t of each 32-bit lane to its low byte (vpshufb indexes within 128-bit lanes: lane j's byte 4j + t)
      const __m512i idx = t ? _mm512_shuffle_epi8(src, _mm512_setr_epi32(t, 4 + t, 8 + t, 12 + t, t, 4 + t, 8 + t,
                                                                         12 + t, t, 4 + t, 8 + t, 12 + t, t, 4 + t,
                                                                         8 + t, 12 + t))
                            : src;
      const __m512 qf = _mm512_permutexvar_ps(idx, tab);   // float(nibble) (Q4_0: nibble - 8)
      use(k, QT == Q4_1 ? _mm512_fmadd_ps(d, qf, m) : _mm512_mul_ps(d, qf));
    }
  }
}

// The 8 accumulators of a row folded (4+4, 2+2, 1+1), its first `valid` outputs stored.
static inline void fold_store(const __m512* a, float* y, int valid) {
  const __m512 t0 = _mm512_add_ps(a[0], a[4]), t1 = _mm512_add_ps(a[1], a[5]);
  const __m512 t2 = _mm512_add_ps(a[2], a[6]), t3 = _mm512_add_ps(a[3], a[7]);
  _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1), _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3)));
}

// A pair against NR (1, 2) rows, accumulators in registers, each block's weights dequantized in registers.
template <int QT, int NR>
static inline void pair_rows(const uint8_t* g, int64_t gs, const float* x, int64_t K, float* y, int64_t N, int valid) {
  constexpr int gb = a8_group_block_bytes(QT);
  __m512 acc[NR][8];
  #pragma GCC unroll 8
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 8
    for (int l = 0; l < 8; l++) acc[r][l] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; b++) {
    const uint8_t* blk = g + b * gb;
    prefetch_ahead(blk, gs, gb, 2);   // the next pair's block
    const float* xb = x + 32 * b;
    block_weights<QT>(blk, gs, [&](int k, __m512 w) {
      #pragma GCC unroll 8
      for (int r = 0; r < NR; r++) acc[r][k % 8] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[r * K + k]), acc[r][k % 8]);
    });
  }
  #pragma GCC unroll 8
  for (int r = 0; r < NR; r++) fold_store(acc[r], y + r * N, valid);
}

// NR (1..3) rows' accumulators (acc: [NR][8][16] floats) take one block's dequantized weights (wb: [32][16]).
template <int NR>
static inline void tile_block(const float* wb, const float* xb, int64_t K, float* am) {
  __m512 acc[NR][8];
  #pragma GCC unroll 8
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 8
    for (int l = 0; l < 8; l++) acc[r][l] = _mm512_load_ps(am + 128 * r + 16 * l);
  #pragma GCC unroll 32
  for (int k = 0; k < 32; k++) {
    const __m512 w = _mm512_load_ps(wb + 16 * k);
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) acc[r][k % 8] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[r * K + k]), acc[r][k % 8]);
  }
  #pragma GCC unroll 8
  for (int r = 0; r < NR; r++)
    #pragma GCC unroll 8
    for (int l = 0; l < 8; l++) _mm512_store_ps(am + 128 * r + 16 * l, acc[r][l]);
}

// A pair against M rows (M <= L1_ROWS): each block dequantized once into L1 (2 KB), then every row in tiles of 3
// takes it, the accumulators kept in memory between blocks (thread-local scratch of M x 8 zmm, 16 KB at 32 rows).
template <int QT>
static void pair_many(const uint8_t* g, int64_t gs, const float* x, int64_t M, int64_t K, float* y, int64_t N,
                      int valid) {
  constexpr int gb = a8_group_block_bytes(QT);
  alignas(64) float wb[32 * 16];
  thread_local std::vector<float> accv;   // 128 floats per row, from a 64-byte boundary
  if ((int64_t)accv.size() < 128 * M + 16) accv.resize(128 * M + 16);
  float* am = (float*)(((uintptr_t)accv.data() + 63) & ~(uintptr_t)63);
  std::memset(am, 0, 128 * M * sizeof(float));
  for (int64_t b = 0; b < K / 32; b++) {
    const uint8_t* blk = g + b * gb;
    prefetch_ahead(blk, gs, gb, 2);
    block_weights<QT>(blk, gs, [&](int k, __m512 w) { _mm512_store_ps(wb + 16 * k, w); });
    for (int64_t r = 0, n; r < M; r += n) {
      n = std::min<int64_t>(3, M - r);
      const float* xb = x + r * K + 32 * b;
      if (n == 3) tile_block<3>(wb, xb, K, am + 128 * r);
      else if (n == 2) tile_block<2>(wb, xb, K, am + 128 * r);
      else tile_block<1>(wb, xb, K, am + 128 * r);
    }
  }
  for (int64_t r = 0; r < M; r++) {
    __m512 a[8];
    #pragma GCC unroll 8
    for (int l = 0; l < 8; l++) a[l] = _mm512_load_ps(am + 128 * r + 16 * l);
    fold_store(a, y + r * N, valid);
  }
}

// From this many rows the blocks go through L1 once per pair (pair_many), below it registers (pair_rows, tiles of
// 2 rows, each tile dequantizing again). A probe on the same Xeon, SmolLM2's 120 Q4_1 products, 2 threads: 3 / 4 /
// 5 / 8 rows 6.4 / 7.4 / 10.3 / 13.4 ms in registers, 6.7 / 8.1 / 9.7 / 12.6 through L1.
constexpr int64_t L1_MIN_ROWS = 5;
// Rows per pass of pair_many, so that their accumulators (512 B a row) stay in L1 beside the block and the rows'
// activations; the pair's blocks are dequantized again per pass (ops.cpp sends at most PACKED_F_MAX_ROWS here).
constexpr int64_t L1_ROWS = 32;

template <int QT>
static void groups_t(const uint8_t* p, const float* x, int64_t M, int64_t K, float* y, int64_t N, int64_t g0,
                     int64_t g1) {
  const int64_t gstride = K / 32 * a8_group_block_bytes(QT);
  for (int64_t gi = g0; gi < g1; gi += 2) {
    const bool pair = gi + 1 < g1;   // a last odd group: its own outputs twice over (gs 0), the first 8 stored
    const int64_t gs = pair ? gstride : 0;
    const int valid = (int)std::min<int64_t>(pair ? 16 : 8, N - 8 * gi);
    const uint8_t* g = p + gi * gstride;
    if (M >= L1_MIN_ROWS) {
      for (int64_t r = 0; r < M; r += L1_ROWS)
        pair_many<QT>(g, gs, x + r * K, std::min(L1_ROWS, M - r), K, y + r * N + 8 * gi, N, valid);
      continue;
    }
    for (int64_t r = 0; r < M; r += 2) {
      if (M - r >= 2) pair_rows<QT, 2>(g, gs, x + r * K, K, y + r * N + 8 * gi, N, valid);
      else pair_rows<QT, 1>(g, gs, x + r * K, K, y + r * N + 8 * gi, N, valid);
    }
  }
}

void linear_groups_f(int qtype, const uint8_t* packed, const float* x, int64_t M, int64_t K, float* y, int64_t N,
                     int64_t g0, int64_t g1) {
  if (qtype == Q4_0) return groups_t<Q4_0>(packed, x, M, K, y, N, g0, g1);
  if (qtype == Q4_1) return groups_t<Q4_1>(packed, x, M, K, y, N, g0, g1);
  return groups_t<Q8_0>(packed, x, M, K, y, N, g0, g1);
}

}  // namespace avx512f
}  // namespace peagle_quant
