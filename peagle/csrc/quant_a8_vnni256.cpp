// The 8-bit-activation products at ymm width through dpbusd (AVX-512 VL + VNNI): quant_a8_ymm.h's kernel, the
// AVX2 path's layout and float operations, each lane's 4 byte products summed into its 32-bit integer in one
// instruction instead of maddubs + add (+ madd). The same exact integers, so the same bits. The AVX2 path
// (impl 2) takes it where the CPU has AVX-512 VNNI: at 2-4 rows, where the AVX2 path's integer work outweighs
// the weights' read and the AVX-512 path's pairs of groups do not yet pay. A row's dpbusd go round-robin into
// several accumulators at 1-3 rows: in one they form a chain of 8 dependent dpbusd per block, whose latency
// rather than throughput bounds a row.
#include <cfloat>      // before the target pragma: a standard header is not built for these targets
#include <cstdint>
#include <cstring>
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#include <immintrin.h>

#include "quant_a8_ymm.h"

namespace peagle_quant {
namespace vnni256 {

struct VnniDot {
  static constexpr int accumulators(int rows) { return rows <= 2 ? 4 : rows <= 3 ? 2 : 1; }
  static inline void q4(__m256i& s, __m256i w, __m256i x) { s = _mm256_dpbusd_epi32(s, w, x); }
  static inline void q8(__m256i& s, __m256i u, __m256i x) { s = _mm256_dpbusd_epi32(s, u, x); }
  template <int QT, int NA>
  static inline __m256i finish(const __m256i* s) {
    __m256i t = s[0];
    #pragma GCC unroll 4
    for (int a = 1; a < NA; a++) t = _mm256_add_epi32(t, s[a]);
    return t;
  }
};

void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  a8ymm::linear_groups<VnniDot>(qtype, packed, xq, xd, xs, M, K, y, N, g0, g1);
}

}  // namespace vnni256
}  // namespace peagle_quant
