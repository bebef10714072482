// AVX-512 path of the training RMSNorm and SwiGLU (train_ops.h): 16 float32 lanes per step, bfloat16 loads widened
// exactly, stores rounded to nearest even; row sums reduced by _mm512_reduce_add_ps (training ops: the tests hold
// them to float64 references within tolerance).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bf16_inline.h"
#include "exp16_inline.h"
#include "train_ops.h"

namespace peagle_tops {

namespace {

using peagle_bf16::load16;
using peagle_bf16::store16;
using peagle_bf16::store_bf16;

// sig(a) on 16 lanes from e^-|a| (never overflows): a >= 0: 1 / (1 + e), else e / (1 + e).
inline __m512 sigmoid16(__m512 a) {
  const __m512 neg_abs = _mm512_min_ps(a, _mm512_sub_ps(_mm512_setzero_ps(), a));
  const __m512 e = peagle_exp::exp_neg16(neg_abs);
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ);
  return _mm512_mask_blend_ps(pos, _mm512_mul_ps(e, inv), inv);
}

}  // namespace

void rms_norm_fwd_avx512(const void* x, bool x_bf16, const float* w, float eps, int64_t H, int64_t r0, int64_t r1,
                         uint16_t* y, float* r) {
  const int64_t es = x_bf16 ? 2 : 4;
  for (int64_t row = r0; row < r1; ++row) {
    const char* xr = (const char*)x + row * H * es;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < H; j += 16) {
      const __m512 v = load16(xr, x_bf16, j);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float rs = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)H + eps);
    r[row] = rs;
    const __m512 vr = _mm512_set1_ps(rs);
    for (int64_t j = 0; j < H; j += 16)
      store_bf16(y + row * H + j, _mm512_mul_ps(_mm512_mul_ps(load16(xr, x_bf16, j), vr), _mm512_loadu_ps(w + j)));
  }
}

void rms_norm_bwd_avx512(const void* x, bool x_bf16, const float* w, const float* r, const void* g, bool g_bf16,
                         int64_t H, int64_t r0, int64_t r1, void* dx, float* dw) {
  const int64_t xs = x_bf16 ? 2 : 4, gs = g_bf16 ? 2 : 4;
  for (int64_t row = r0; row < r1; ++row) {
    const char* xr = (const char*)x + row * H * xs;
    const char* gr = (const char*)g + row * H * gs;
    char* dr = (char*)dx + row * H * xs;
    const float rs = r[row];
    const __m512 vr = _mm512_set1_ps(rs);
    __m512 dot = _mm512_setzero_ps();
    for (int64_t j = 0; j < H; j += 16) {
      const __m512 xv = load16(xr, x_bf16, j), gv = load16(gr, g_bf16, j);
      dot = _mm512_fmadd_ps(_mm512_mul_ps(gv, _mm512_loadu_ps(w + j)), xv, dot);
      _mm512_storeu_ps(dw + j, _mm512_fmadd_ps(_mm512_mul_ps(gv, xv), vr, _mm512_loadu_ps(dw + j)));
    }
    const __m512 c = _mm512_set1_ps(rs * rs * rs * _mm512_reduce_add_ps(dot) / (float)H);
    for (int64_t j = 0; j < H; j += 16) {
      const __m512 gw = _mm512_mul_ps(load16(gr, g_bf16, j), _mm512_loadu_ps(w + j));
      store16(dr, x_bf16, j, _mm512_sub_ps(_mm512_mul_ps(gw, vr), _mm512_mul_ps(load16(xr, x_bf16, j), c)));
    }
  }
}

void swiglu_fwd_avx512(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t I, int64_t r0,
                       int64_t r1, uint16_t* h) {
  for (int64_t row = r0; row < r1; ++row)
    for (int64_t j = 0; j < I; j += 16) {
      const __m512 av = load16(a + row * lda, true, j), bv = load16(b + row * ldb, true, j);
      store_bf16(h + row * I + j, _mm512_mul_ps(_mm512_mul_ps(av, sigmoid16(av)), bv));
    }
}

void swiglu_bwd_avx512(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, const uint16_t* dh, int64_t I,
                       int64_t r0, int64_t r1, uint16_t* da, uint16_t* db) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t row = r0; row < r1; ++row)
    for (int64_t j = 0; j < I; j += 16) {
      const __m512 av = load16(a + row * lda, true, j), bv = load16(b + row * ldb, true, j);
      const __m512 d = load16(dh + row * I, true, j), s = sigmoid16(av);
      const __m512 ds = _mm512_fmadd_ps(av, _mm512_sub_ps(one, s), one);     // 1 + a (1 - sig a)
      store_bf16(da + row * I + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(d, bv), s), ds));
      store_bf16(db + row * I + j, _mm512_mul_ps(d, _mm512_mul_ps(av, s)));
    }
}

}  // namespace peagle_tops
