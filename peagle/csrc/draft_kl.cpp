// Python binding of the fused draft loss (draft_kl.h): elements split over threads (each element's row computed
// whole by one thread), AVX-512 where the CPU has it, else AVX2; peagle/train/head_forward.py runs its torch
// form where neither is.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "draft_kl.h"
#include "ops.h"

namespace pk = peagle_kl;

// impl: 0 = best for this CPU, 2 = AVX2, 3 = AVX-512 (ops.h's numbering; 3 without AVX-512 raises).
static bool use_wide(int64_t impl) {
  TORCH_CHECK(impl == 0 || impl == 2 || impl == 3, "draft_kl: impl 0, 2 or 3");
  TORCH_CHECK(impl != 3 || peagle_ops::has_avx512(), "draft_kl: this CPU has no AVX-512");
  return impl == 3 || (impl == 0 && peagle_ops::has_avx512());
}

static pk::KLArgs kl_args(const torch::Tensor& z, const torch::Tensor& t, const torch::Tensor& rows) {
  TORCH_CHECK(peagle_ops::has_avx2(), "draft_kl: needs AVX2 + FMA + F16C");
  TORCH_CHECK(z.device().is_cpu() && z.dim() == 2 && z.stride(1) == 1 &&
              (z.scalar_type() == torch::kFloat32 || z.scalar_type() == torch::kBFloat16),
              "draft_kl: logits [E, V] float32 or bfloat16 on the CPU, rows contiguous");
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1 &&
              t.size(1) == z.size(1) && z.size(1) % 8 == 0, "draft_kl: tlogp [n, V] float32, V a multiple of 8");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.is_contiguous() && rows.dim() == 1 &&
              rows.size(0) == z.size(0), "draft_kl: rows [E] int64");
  if (rows.numel())
    TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < t.size(0),
                "draft_kl: rows out of range");
  return pk::KLArgs{z.data_ptr(), z.scalar_type() == torch::kBFloat16, z.stride(0), t.data_ptr<float>(), t.stride(0),
                    rows.data_ptr<int64_t>(), z.size(1)};
}

// (kl [E], lse [E], top [E] int64) of logits z [E, V] against tlogp t [n, V] at rows [E].
static std::vector<torch::Tensor> draft_kl_forward(torch::Tensor z, torch::Tensor t, torch::Tensor rows, int64_t impl) {
  const auto a = kl_args(z, t, rows);
  const bool wide = use_wide(impl);
  const int64_t E = z.size(0);
  auto kl = torch::empty({E}, z.options().dtype(torch::kFloat32)), lse = torch::empty_like(kl);
  auto top = torch::empty({E}, z.options().dtype(torch::kInt64));
  float *klp = kl.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  int64_t* topp = top.data_ptr<int64_t>();
  at::parallel_for(0, E, 4, [&](int64_t e0, int64_t e1) { 
    if (wide) pk::forward_avx512(a, e0, e1, klp, lsep, topp);
    else pk::forward_avx2(a, e0, e1, klp, lsep, topp);
  });
  return {kl, lse, top};
}

// d kl / d z scaled per element by g [E]: [E, V] in z's dtype.
static torch::Tensor draft_kl_backward(torch::Tensor z, torch::Tensor t, torch::Tensor rows, torch::Tensor lse,
                                       torch::Tensor g, int64_t impl) {
  const auto a = kl_args(z, t, rows);
  const bool wide = use_wide(impl);
  const int64_t E = z.size(0);
  TORCH_CHECK(lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() && lse.numel() == E, "draft_kl: lse [E]");
  auto gc = g.to(torch::kFloat32).contiguous();
  TORCH_CHECK(gc.numel() == E, "draft_kl: g [E]");
  auto grad = torch::empty({E, z.size(1)}, z.options().memory_format(at::MemoryFormat::Contiguous));
  const float *lsep = lse.data_ptr<float>(), *gp = gc.data_ptr<float>();
  void* out = grad.data_ptr();
  at::parallel_for(0, E, 4, [&](int64_t e0, int64_t e1) { 
    if (wide) pk::backward_avx512(a, e0, e1, lsep, gp, out);
    else pk::backward_avx2(a, e0, e1, lsep, gp, out);
  });
  return grad;
}

void bind_draft_kl(py::module& m) {
  m.def("draft_kl_forward", &draft_kl_forward, "KL(target || draft) per element, its logsumexp and greedy id",
        py::arg("z"), py::arg("t"), py::arg("rows"), py::arg("impl") = 0);
  m.def("draft_kl_backward", &draft_kl_backward, "its gradient w.r.t. the logits, scaled per element", py::arg("z"),
        py::arg("t"), py::arg("rows"), py::arg("lse"), py::arg("g"), py::arg("impl") = 0);
}
