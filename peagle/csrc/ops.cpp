// peagle's CPU ops on raw buffers (ops.h): how each splits its work over threads and which path it takes.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "exp1_inline.h"
#include "quant_kernels.h"

namespace pq = peagle_quant;
namespace pa = peagle_attend;
namespace peagle_attend {
// attend(a, t0, t1) computes tasks t0..t1-1 of tasks(a) (each path's own split of the queries)
namespace avx512 { int64_t tasks(const AttnArgs& a); void attend(const AttnArgs& a, int64_t t0, int64_t t1); }
namespace avx2 { int64_t tasks(const AttnArgs& a); void attend(const AttnArgs& a, int64_t t0, int64_t t1); }
namespace generic { int64_t tasks(const AttnArgs& a); void attend(const AttnArgs& a, int64_t t0, int64_t t1); }
}  // namespace peagle_attend

namespace peagle_ops {

bool has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

bool has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

bool has_amx() { return has_avx512() && pq::amx::available(); }

bool has_amx_bf16() {   // AMX-BF16, with the tile state granted (has_amx)
  static const bool ok = has_amx() && ((pq::amx::cpuid7_edx() >> 22) & 1);
  return ok;
}

bool use_avx2(int64_t impl) {
  TORCH_CHECK(impl >= 0 && impl <= 4, "unknown kernel path impl=", impl,
              " (0 best, 1 scalar, 2 AVX2, 3 AVX-512, 4 AMX)");
  TORCH_CHECK(impl != 2 || has_avx2(), "this CPU has no AVX2+FMA+F16C");
  TORCH_CHECK(impl != 3 || has_avx512(), "this CPU has no AVX-512 F/VL/BW/DQ + VNNI");
  TORCH_CHECK(impl != 4 || has_amx(), "this CPU (or its OS) runs no AMX-INT8 tiles");
  return impl >= 2 || (impl == 0 && has_avx2());
}

bool use_avx512(int64_t impl) { return use_avx2(impl) && (impl >= 3 || (impl == 0 && has_avx512())); }

bool use_amx(int64_t impl, int64_t M) {
  return use_avx2(impl) && (impl == 4 || (impl == 0 && M >= AMX_MIN_ROWS && has_amx()));
}

// [act8][F32, Q4_0, Q4_1, Q8_0]: AVX-512 from this many rows (set once, before the products run)
static int64_t g_avx512_min_rows[2][4] = {{1, 1, 1, 1}, {1, 1, 1, 1}};

static int64_t& min_rows_slot(int qtype, bool act8) {
  const int i = qtype == pq::F32 ? 0 : qtype == pq::Q4_0 ? 1 : qtype == pq::Q4_1 ? 2 : qtype == pq::Q8_0 ? 3 : -1;
  TORCH_CHECK(i >= 0, "unknown weight type ", qtype);
  TORCH_CHECK(!(act8 && i == 0), "F32 weights take no 8-bit activations");
  return g_avx512_min_rows[act8][i];
}

void set_avx512_min_rows(int qtype, bool act8, int64_t rows) {
  TORCH_CHECK(rows >= 1, "AVX-512 from at least 1 row, got ", rows);
  min_rows_slot(qtype, act8) = rows;
}

int64_t avx512_min_rows(int qtype, bool act8) { return min_rows_slot(qtype, act8); }

// The AVX2 path's 8-bit-activation products: dpbusd on ymm where the CPU has AVX-512 VNNI (vnni256), else
// maddubs (same bits); tests switch the VNNI form off to check the other on such a CPU.
static std::atomic<bool> g_avx2_vnni{true};   // set by tests while another thread may decode

void set_avx2_vnni(bool on) {
  TORCH_CHECK(!on || has_avx512(), "this CPU has no AVX-512 VL + VNNI for the AVX2 path's dpbusd");
  g_avx2_vnni.store(on, std::memory_order_relaxed);
}

bool avx2_vnni() { return g_avx2_vnni.load(std::memory_order_relaxed) && has_avx512(); }

int64_t product_impl(int64_t impl, int qtype, bool act8, int64_t M) {
  if (impl != 0 || !has_avx512()) return impl;
  return M < min_rows_slot(qtype, act8) ? 2 : 0;
}

// The block types' packed AVX-512 path up to this many rows; above, the AVX2 path's register tiles over an L1
// scratch, which measured as fast at 64 rows and 1.02x (median) / 1.08x (min) faster at 128 (a prefill's passes)
// on a 2-core Intel Xeon, SmolLM2's q4 products (lab/measure/kernel_ab.py).
constexpr int64_t PACKED_F_MAX_ROWS = 64;

void qlinear(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint8_t* packed, int qtype, int64_t N,
             int64_t impl, float* y) {
  if (M == 0) return;
  impl = product_impl(impl, qtype, false, M);
  const int64_t MB = pq::ROW_BLOCK;                               // rows per pass over the weights
  if (packed != nullptr && qtype != pq::F32 && use_avx512(impl) && M <= PACKED_F_MAX_ROWS) {
    const int64_t G = (N + 7) / 8;   // tasks of whole pairs of groups (the kernel's zmm), a last odd group alone
    at::parallel_for(0, (G + 1) / 2, std::max<int64_t>(1, 1024 / K), [&](int64_t p0, int64_t p1) {
      pq::avx512f::linear_groups_f(qtype, packed, x, M, K, y, N, 2 * p0, std::min(2 * p1, G));
    });
    return;
  }
  pq::LinearFn fn = use_avx512(impl) ? pq::avx512::linear_rows
                    : use_avx2(impl) ? pq::avx2::linear_rows : pq::scalar::linear_rows;
  const int64_t rb = K / 32 * pq::block_bytes(qtype);
  // tasks of whole groups of 4 outputs (F32: 8, its kernel's group); an output is computed whole by one thread,
  // so the split changes nothing
  const int64_t G = qtype == pq::F32 ? 8 : 4, groups = (N + G - 1) / G, grain = std::max<int64_t>(1, 16384 / (G * K));
  for (int64_t r0 = 0; r0 < M; r0 += MB) {
    const int64_t m = std::min(MB, M - r0);
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      std::vector<float> buf(4 * K);
      fn(qtype, w, rb, x + r0 * K, m, K, y + r0 * N, N, G * g0, std::min(G * g1, N), buf.data());
    });
  }
}

void qlinear_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint8_t* packed, int qtype, int64_t N,
                int64_t impl, Act8 s, float* y) {
  if (M == 0) return;
  impl = product_impl(impl, qtype, true, M);
  const bool vec = use_avx2(impl);
  const int64_t nb = K / 32;
  at::parallel_for(0, M, SMALL_OP_ROWS, [&](int64_t r0, int64_t r1) {   // row by row: any split, the same bits
    (vec ? pq::avx2::quantize_act : pq::quantize_act)(x + r0 * K, r1 - r0, K, s.xq + r0 * K, s.xd + r0 * nb,
                                                      s.xs + r0 * nb);
  });
  if (vec) {
    auto fn = use_amx(impl, M) ? pq::amx::linear_groups_a8
              : use_avx512(impl) ? pq::avx512::linear_groups_a8
              : avx2_vnni() ? pq::vnni256::linear_groups_a8 : pq::avx2::linear_groups_a8;
    at::parallel_for(0, (N + 7) / 8, std::max<int64_t>(1, 2048 / K), [&](int64_t g0, int64_t g1) {
      fn(qtype, packed, s.xq, s.xd, s.xs, M, K, y, N, g0, g1);
    });
  } else {
    const int64_t rb = K / 32 * pq::block_bytes(qtype);
    at::parallel_for(0, N, std::max<int64_t>(1, 8192 / K), [&](int64_t n0, int64_t n1) {
      pq::scalar::linear_rows_a8(qtype, w, rb, s.xq, s.xd, s.xs, M, K, y, N, n0, n1);
    });
  }
}

void add_rms_norm(const float* x, const float* h, const float* w, int64_t R, int64_t H, float eps, float* res,
                  float* out) {
  at::parallel_for(0, R, SMALL_OP_ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float *a = x + r * H, *b = h + r * H;
      float* s = res + r * H;
      double ss = 0.0;
      for (int64_t i = 0; i < H; i++) {
        s[i] = a[i] + b[i];
        ss += (double)s[i] * (double)s[i];
      }
      const float inv = (float)(1.0 / std::sqrt(ss / (double)H + (double)eps));
      float* o = out + r * H;
      for (int64_t i = 0; i < H; i++) o[i] = (s[i] * inv) * w[i];
    }
  });
}

void rms_norm(const float* x, const float* w, int64_t R, int64_t H, float eps, float* out) {
  at::parallel_for(0, R, SMALL_OP_ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* a = x + r * H;
      double ss = 0.0;
      for (int64_t i = 0; i < H; i++) ss += (double)a[i] * (double)a[i];
      const float inv = (float)(1.0 / std::sqrt(ss / (double)H + (double)eps));
      float* o = out + r * H;
      for (int64_t i = 0; i < H; i++) o[i] = (a[i] * inv) * w[i];
    }
  });
}

void silu_mul(const float* gu, int64_t R, int64_t I, float* out, int64_t impl) {
  const bool vec = use_avx2(impl);
  at::parallel_for(0, R, SMALL_OP_ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float *a = gu + r * 2 * I, *b = a + I;
      float* o = out + r * I;
      if (vec) {
        pq::avx2::silu_mul(a, b, o, I);
        continue;
      }
      for (int64_t i = 0; i < I; i++) o[i] = a[i] / (1.0f + peagle_exp::exp1(-a[i])) * b[i];   // the vector's bits
    }
  });
}

void rope_kv(const float* qkv, const float* cos, const float* sin, const int64_t* pos, int64_t B, int64_t T,
             int64_t nh, int64_t nkv, int64_t hd, void* kc, void* vc, bool bf16, int64_t cap, int64_t b0, float* q) {
  const int64_t W = (nh + 2 * nkv) * hd, half = hd / 2;
  // element i of cache c's row at element offset `at`: the float32 value, or it rounded to bfloat16 by torch's
  // own conversion (c10: nearest even, a NaN to 0x7fc0), so the bits of a copy_ into a bfloat16 tensor
  auto put = [bf16](void* c, int64_t at, int64_t i, float f) {
    if (bf16) ((uint16_t*)c)[at + i] = c10::BFloat16(f).x;
    else ((float*)c)[at + i] = f;
  };
  at::parallel_for(0, B * T, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t bt = r0; bt < r1; bt++) {
      const float *x = qkv + bt * W, *cs = cos + bt * hd, *sv = sin + bt * hd;
      const int64_t b = bt / T;
      for (int64_t h = 0; h < nh + nkv; h++) {
        const float* xh = x + h * hd;
        auto rot = [&](int64_t i) {
          return i < half ? xh[i] * cs[i] + (-xh[i + half]) * sv[i] : xh[i] * cs[i] + xh[i - half] * sv[i];
        };
        if (h < nh) {
          for (int64_t i = 0; i < hd; i++) q[(bt * nh + h) * hd + i] = rot(i);
        } else {
          const int64_t at = (((b0 + b) * nkv + (h - nh)) * cap + pos[bt]) * hd;
          for (int64_t i = 0; i < hd; i++) put(kc, at, i, rot(i));
        }
      }
      for (int64_t h = 0; h < nkv; h++)
        for (int64_t i = 0; i < hd; i++)
          put(vc, (((b0 + b) * nkv + h) * cap + pos[bt]) * hd, i, x[(nh + nkv + h) * hd + i]);
    }
  });
}

void compact_kv(char* k, char* v, int64_t esize, int64_t nkv, int64_t cap, int64_t hd, int64_t b0, int64_t B,
                const int64_t* start, const int64_t* path, int64_t W) {
  const int64_t row = hd * esize;   // one position's bytes
  std::vector<char> tmp(W * row);
  for (char* store : {k, v})
    for (int64_t b = 0; b < B; b++)
      for (int64_t g = 0; g < nkv; g++) {
        char* base = store + ((b0 + b) * nkv + g) * cap * row + start[b] * row;
        for (int64_t i = 0; i < W; i++) std::memcpy(tmp.data() + i * row, base + path[b * W + i] * row, row);
        std::memcpy(base, tmp.data(), W * row);
      }
}

void attend(const pa::AttnArgs& a, int64_t impl) {
  const bool vec = use_avx2(impl), wide = use_avx512(impl);
  auto fn = wide ? pa::avx512::attend : vec ? pa::avx2::attend : pa::generic::attend;
  const int64_t n = (wide ? pa::avx512::tasks : vec ? pa::avx2::tasks : pa::generic::tasks)(a);
  const int64_t grain = std::max<int64_t>(1, 16384 * n / std::max<int64_t>(1, a.B * a.T * a.nh * a.S * a.hd));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) { fn(a, i0, i1); });
}

}  // namespace peagle_ops
