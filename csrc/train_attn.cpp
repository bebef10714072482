// Python binding of the training attention's softmax and score products (train_attn.h): rows split over threads,
// AVX-512 only (the scores: AMX-BF16); peagle/train/train_attention.py runs torch's attention where the CPU has
// no AVX-512 and torch's float32 products for the scores where it has no AMX-BF16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "train_attn.h"

namespace pt = peagle_tattn;

static void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(peagle_ops::has_avx512(), "train_attn: this CPU has no AVX-512");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "train_attn: ", what, " [R, S] float32, contiguous");
}

// (p float32 [R, S], p bfloat16 [R, S]) of scores s [R, S] under mask [T, S] (R a multiple of T).
static std::vector<torch::Tensor> attn_softmax_forward(torch::Tensor s, torch::Tensor mask, double scale) {
  check_rows(s, "scores");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.is_contiguous() &&
              mask.size(1) == s.size(1) && mask.size(0) > 0 && s.size(0) % mask.size(0) == 0,
              "train_attn: mask [T, S] bool, contiguous, R a multiple of T");
  auto p = torch::empty_like(s), p16 = torch::empty(s.sizes(), s.options().dtype(torch::kBFloat16));
  const int64_t T = mask.size(0), S = s.size(1);
  const float* sp = s.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* pp = p.data_ptr<float>();
  uint16_t* p16p = (uint16_t*)p16.data_ptr();
  at::parallel_for(0, s.size(0), 16, [&](int64_t r0, int64_t r1) {
    pt::FlushDenormals ftz;
    pt::softmax_fwd_avx512(sp, mp, T, S, (float)scale, r0, r1, pp, p16p);
  });
  return {p, p16};
}

// d loss / d raw scores, bfloat16 [R, S], from dp = d loss / d p and p (both [R, S] float32).
static torch::Tensor attn_softmax_backward(torch::Tensor dp, torch::Tensor p, double scale) {
  check_rows(dp, "dp");
  check_rows(p, "p");
  TORCH_CHECK(dp.sizes() == p.sizes(), "train_attn: dp and p of one shape");
  auto ds = torch::empty(p.sizes(), p.options().dtype(torch::kBFloat16));
  const float *g = dp.data_ptr<float>(), *q = p.data_ptr<float>();
  uint16_t* o = (uint16_t*)ds.data_ptr();
  const int64_t S = p.size(1);
  at::parallel_for(0, p.size(0), 16, [&](int64_t r0, int64_t r1) {
    pt::FlushDenormals ftz;
    pt::softmax_bwd_avx512(g, q, S, (float)scale, r0, r1, o);
  });
  return ds;
}

// float32 [B, H, M, N] = a [B, H, M, D] b [B, H, N, D]^T of bfloat16 a and b (last dims contiguous, D even).
static torch::Tensor attn_scores(torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(peagle_ops::has_amx_bf16(), "train_attn: this CPU (or its OS) runs no AMX-BF16 tiles");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == torch::kBFloat16 &&
              b.scalar_type() == torch::kBFloat16 && a.dim() == 4 && b.dim() == 4 && a.size(0) == b.size(0) &&
              a.size(1) == b.size(1) && a.size(3) == b.size(3) && a.size(3) % 32 == 0 && a.stride(3) == 1 &&
              b.stride(3) == 1, "train_attn: scores of a [B, H, M, D], b [B, H, N, D] bfloat16, D a multiple of 32, last dims "
              "contiguous");
  const int64_t B = a.size(0), H = a.size(1), M = a.size(2), N = b.size(2), D = a.size(3), G = B * H;
  auto out = torch::empty({B, H, M, N}, a.options().dtype(torch::kFloat32));
  const int64_t P = pt::packed_pairs_size(N, D);
  auto packed = torch::empty({G, P}, a.options());
  const auto* ap = (const uint16_t*)a.data_ptr();
  const auto* bp = (const uint16_t*)b.data_ptr();
  auto* pp = (uint16_t*)packed.data_ptr();
  float* op = out.data_ptr<float>();
  auto at_ = [](const torch::Tensor& t, int64_t g) { return (g / t.size(1)) * t.stride(0) + (g % t.size(1)) * t.stride(1); };
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) pt::pack_pairs(bp + at_(b, g), b.stride(2), N, D, pp + g * P);
  });
  constexpr int64_t CH = 64;                     // rows per task (a multiple of the kernel's 32-row step)
  const int64_t chunks = (M + CH - 1) / CH;
  at::parallel_for(0, G * chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t g = t / chunks, m0 = (t % chunks) * CH, m1 = std::min(M, m0 + CH);
      pt::scores_amx(ap + at_(a, g), a.stride(2), pp + g * P, N, D, m0, m1, op + g * M * N, N);
    }
  });
  return out;
}

void bind_train_attn(py::module& m) {
  m.def("attn_scores", &attn_scores, "training attention's score products a b^T (bfloat16 in, float32 out; AMX)",
        py::arg("a"), py::arg("b"));
  m.def("attn_softmax_forward", &attn_softmax_forward, "training attention's masked softmax (float32, bfloat16)",
        py::arg("s"), py::arg("mask"), py::arg("scale"));
  m.def("attn_softmax_backward", &attn_softmax_backward, "its gradient w.r.t. the raw scores (bfloat16)",
        py::arg("dp"), py::arg("p"), py::arg("scale"));
}
