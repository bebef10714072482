// Python binding of the training attention's softmax (train_attn.h): rows split over threads, AVX-512 only;
// peagle/train/train_attention.py runs torch's attention where the CPU has no AVX-512.
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
    pt::softmax_bwd_avx512(g, q, S, (float)scale, r0, r1, o);
  });
  return ds;
}

void bind_train_attn(py::module& m) {
  m.def("attn_softmax_forward", &attn_softmax_forward, "training attention's masked softmax (float32, bfloat16)",
        py::arg("s"), py::arg("mask"), py::arg("scale"));
  m.def("attn_softmax_backward", &attn_softmax_backward, "its gradient w.r.t. the raw scores (bfloat16)",
        py::arg("dp"), py::arg("p"), py::arg("scale"));
}
