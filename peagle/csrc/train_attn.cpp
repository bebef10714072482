// Python binding of the training attention's softmax passes and AMX products (train_attn.h): rows split over
// threads. attn_softmax_* (AVX-512) run between torch's float32 score products; attn_probs / attn_dscores (AMX-BF16)
// fuse the scores, the pass and the P V / dS K products per strip of 32 rows. peagle/train/train_attention.py runs
// torch's attention where the CPU has no AVX-512.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "train_attn.h"

namespace pt = peagle_tattn;

static void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(peagle_ops::has_avx512(), "train_attn: this CPU has no AVX-512");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "train_attn: ", what, " [R, S] float32, contiguous");
}

// A mask [T, S] for R query rows of S keys: bool, contiguous, R a multiple of T.
static void check_mask(const torch::Tensor& mask, int64_t R, int64_t S) {
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.is_contiguous() && mask.size(1) == S &&
              mask.size(0) > 0 && R % mask.size(0) == 0,
              "train_attn: mask [T, S] bool, contiguous, rows a multiple of T");
}

// p bfloat16 [R, S] of scores s [R, S] float32 under mask [T, S] (R a multiple of T).
static torch::Tensor attn_softmax_forward(torch::Tensor s, torch::Tensor mask, double scale) {
  check_rows(s, "scores");
  check_mask(mask, s.size(0), s.size(1));
  auto p16 = torch::empty(s.sizes(), s.options().dtype(torch::kBFloat16));
  const int64_t T = mask.size(0), S = s.size(1);
  const float* sp = s.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  uint16_t* p16p = (uint16_t*)p16.data_ptr();
  at::parallel_for(0, s.size(0), 16, [&](int64_t r0, int64_t r1) {
    pt::FlushDenormals ftz;
    std::vector<float> e(S);
    pt::softmax_fwd_avx512(sp + r0 * S, mp, T, S, (float)scale, r0, r1 - r0, e.data(), p16p + r0 * S);
  });
  return p16;
}

// d loss / d raw scores, bfloat16 [R, S], from dp = d loss / d p [R, S] float32 and p [R, S] bfloat16.
static torch::Tensor attn_softmax_backward(torch::Tensor dp, torch::Tensor p16, double scale) {
  check_rows(dp, "dp");
  TORCH_CHECK(p16.scalar_type() == torch::kBFloat16 && p16.is_contiguous() && dp.sizes() == p16.sizes(),
              "train_attn: p [R, S] bfloat16, contiguous, of dp's shape");
  auto ds = torch::empty(p16.sizes(), p16.options());
  const float* g = dp.data_ptr<float>();
  const uint16_t* q = (const uint16_t*)p16.data_ptr();
  uint16_t* o = (uint16_t*)ds.data_ptr();
  const int64_t S = p16.size(1);
  at::parallel_for(0, p16.size(0), 16, [&](int64_t r0, int64_t r1) {
    pt::FlushDenormals ftz;
    pt::softmax_bwd_avx512(g + r0 * S, q + r0 * S, S, (float)scale, r1 - r0, o + r0 * S);
  });
  return ds;
}

using Parts = std::vector<torch::Tensor>;

static void check_heads(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(peagle_ops::has_amx_bf16(), "train_attn: this CPU (or its OS) runs no AMX-BF16 tiles");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == torch::kBFloat16 &&
              b.scalar_type() == torch::kBFloat16 && a.dim() == 4 && b.dim() == 4 && a.size(0) == b.size(0) &&
              a.size(1) == b.size(1) && a.size(3) == b.size(3) && a.size(3) % 32 == 0 && a.stride(3) == 1 &&
              b.stride(3) == 1, "train_attn: a [B, H, M, D], b [B, H, N, D] bfloat16, D a multiple of 32, last dims "
              "contiguous");
}

// Element offset of head g (of B * H) in t [B, H, ..].
static int64_t head_at(const torch::Tensor& t, int64_t g) {
  return (g / t.size(1)) * t.stride(0) + (g % t.size(1)) * t.stride(1);
}

// The keys (or values) as parts [B, H, n_i, D] concatenated along n, each checked against a: (row pointers
// [B * H][N] into the parts, N).
static std::pair<std::vector<const uint16_t*>, int64_t> rows_of(const torch::Tensor& a, const Parts& parts) {
  TORCH_CHECK(!parts.empty(), "train_attn: no key parts");
  int64_t N = 0;
  for (const auto& t : parts) check_heads(a, t), N += t.size(2);
  const int64_t G = a.size(0) * a.size(1);
  std::vector<const uint16_t*> rows(G * N);
  for (int64_t g = 0; g < G; g++) {
    int64_t j = 0;
    for (const auto& t : parts) {
      const auto* base = (const uint16_t*)t.data_ptr() + head_at(t, g);
      for (int64_t i = 0; i < t.size(2); i++) rows[g * N + j++] = base + i * t.stride(2);
    }
  }
  return {std::move(rows), N};
}

constexpr int64_t CH = 32;   // rows per task: one strip of the kernel's 32-row step, its scores kept in cache

// For each head and strip of CH rows of a [B, H, M, D]: the strip's scores a b^T [CH, N] (AMX, into scratch),
// then fn(head, first row, rows, scores). b: the keys' parts (rows_of), packed once per head.
template <class Fn>
static void strips(const torch::Tensor& a, const Parts& b, Fn fn) {
  const auto [rows, N] = rows_of(a, b);
  const int64_t G = a.size(0) * a.size(1), M = a.size(2), D = a.size(3);
  const int64_t P = pt::round32(N) * D;
  auto packed = torch::empty({G, P}, a.options());
  const auto* ap = (const uint16_t*)a.data_ptr();
  auto* pp = (uint16_t*)packed.data_ptr();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) pt::pack_pairs(rows.data() + g * N, N, D, pp + g * P);
  });
  const int64_t chunks = (M + CH - 1) / CH;
  at::parallel_for(0, G * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(CH * N);
    for (int64_t t = t0; t < t1; t++) {
      const int64_t g = t / chunks, m0 = (t % chunks) * CH, n = std::min(M, m0 + CH) - m0;
      pt::scores_amx(ap + head_at(a, g) + m0 * a.stride(2), a.stride(2), pp + g * P, N, D, 0, n, s.data(), N);
      fn(g, m0, n, s.data());
    }
  });
}

// Each head of the parts x (rows_of against a) packed in pairs along the keys (pack_pairs_k): [B * H, Kp * D].
static torch::Tensor pack_k(const torch::Tensor& a, const Parts& x) {
  const auto [rows, K] = rows_of(a, x);
  const int64_t G = a.size(0) * a.size(1), D = a.size(3), P = pt::round32(K) * D;
  auto out = torch::empty({G, P}, a.options());
  auto* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) pt::pack_pairs_k(rows.data() + g * K, K, D, op + g * P);
  });
  return out;
}

static int64_t length(const Parts& x) {
  int64_t n = 0;
  for (const auto& t : x) n += t.size(2);
  return n;
}

// rows n of bfloat16 p (N keys, rows N apart) times head g of the packed xp -> float32 rows of out [.., D].
static void strip_times(const uint16_t* p, int64_t n, int64_t N, const torch::Tensor& xp, int64_t g, int64_t D,
                        float* out) {
  const int64_t Kp = pt::round32(N);
  std::vector<uint16_t> strip(CH * Kp, 0);             // [32, Kp]: the rows, zero keys past N and rows past n
  for (int64_t r = 0; r < n; r++) std::memcpy(strip.data() + r * Kp, p + r * N, 2 * N);
  pt::strip_times_amx(strip.data(), Kp, n, (const uint16_t*)xp.data_ptr() + g * xp.size(1), D, out, D);
}

// (p [B, H, M, N] bfloat16, o = p v [B, H, M, D] float32): the masked softmax (mask [T, N], M a multiple of T) of
// the scores q k^T * scale, and its product with v; k and v given as parts [B, H, n_i, D] concatenated along the
// keys (N = sum n_i, no gathered copy); the scores and each strip of p stay in cache.
static std::vector<torch::Tensor> attn_probs(torch::Tensor q, Parts k, Parts v, torch::Tensor mask, double scale) {
  const int64_t M = q.size(2), N = length(k), D = q.size(3);
  TORCH_CHECK(length(v) == N, "train_attn: k and v of one length");
  check_mask(mask, M, N);
  auto p = torch::empty({q.size(0), q.size(1), M, N}, q.options());
  auto o = torch::empty({q.size(0), q.size(1), M, D}, q.options().dtype(torch::kFloat32));
  auto* pp = (uint16_t*)p.data_ptr();
  float* op = o.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  const auto vp = pack_k(q, v);
  strips(q, k, [&](int64_t g, int64_t m0, int64_t n, const float* s) {
    pt::FlushDenormals ftz;
    std::vector<float> e(N);
    uint16_t* rows = pp + (g * M + m0) * N;
    pt::softmax_fwd_avx512(s, mp, mask.size(0), N, (float)scale, m0, n, e.data(), rows);
    strip_times(rows, n, N, vp, g, D, op + (g * M + m0) * D);
  });
  return {p, o};
}

// (dS [B, H, M, N] bfloat16, dq = dS k [B, H, M, D] float32): d loss / d raw scores from dO [B, H, M, D],
// v (dp = dO v^T, in cache) and p [B, H, M, N] bfloat16 (attn_probs'), and its product with the keys k; k and v
// as attn_probs takes them.
static std::vector<torch::Tensor> attn_dscores(torch::Tensor dout, Parts v, torch::Tensor p, Parts k, double scale) {
  const int64_t M = dout.size(2), N = length(v), D = dout.size(3);
  TORCH_CHECK(length(k) == N, "train_attn: k and v of one length");
  TORCH_CHECK(p.scalar_type() == torch::kBFloat16 && p.is_contiguous() && p.dim() == 4 && p.size(0) == dout.size(0) &&
              p.size(1) == dout.size(1) && p.size(2) == M && p.size(3) == N, "train_attn: p [B, H, M, N] bfloat16");
  auto ds = torch::empty_like(p);
  auto dq = torch::empty({dout.size(0), dout.size(1), M, D}, dout.options().dtype(torch::kFloat32));
  auto* dsp = (uint16_t*)ds.data_ptr();
  float* dqp = dq.data_ptr<float>();
  const auto* pp = (const uint16_t*)p.data_ptr();
  const auto kp = pack_k(dout, k);
  strips(dout, v, [&](int64_t g, int64_t m0, int64_t n, const float* s) {
    pt::FlushDenormals ftz;
    uint16_t* rows = dsp + (g * M + m0) * N;
    pt::softmax_bwd_avx512(s, pp + (g * M + m0) * N, N, (float)scale, n, rows);
    strip_times(rows, n, N, kp, g, D, dqp + (g * M + m0) * D);
  });
  return {ds, dq};
}

void bind_train_attn(py::module& m) {
  m.def("attn_probs", &attn_probs, "its masked softmax of the scores q k^T (bfloat16) and p v (AMX)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"));
  m.def("attn_dscores", &attn_dscores, "its gradient w.r.t. the raw scores (bfloat16) and dS k (AMX)",
        py::arg("dout"), py::arg("v"), py::arg("p"), py::arg("k"), py::arg("scale"));
  m.def("attn_softmax_forward", &attn_softmax_forward, "training attention's masked softmax (bfloat16)",
        py::arg("s"), py::arg("mask"), py::arg("scale"));
  m.def("attn_softmax_backward", &attn_softmax_backward, "its gradient w.r.t. the raw scores (bfloat16)",
        py::arg("dp"), py::arg("p"), py::arg("scale"));
}
