// Python binding of the training RMSNorm and SwiGLU (train_ops.h): rows split over threads, AVX-512 only;
// peagle/train/train_ops.py runs torch ops of the same formulas where the CPU has no AVX-512.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "train_ops.h"

namespace {

constexpr int64_t CHUNK = 64;   // rows per task; the norm's weight gradient is summed per chunk, then over chunks

bool rows_of(const torch::Tensor& t, int64_t n, const char* what, bool bf16_only) {
  const bool bf = t.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == n && n % 16 == 0 && t.stride(1) == 1 &&
                  (bf || (!bf16_only && t.scalar_type() == torch::kFloat32)),
              what, ": [R, ", n, "] rows with unit column stride, ", bf16_only ? "bfloat16" : "float32 or bfloat16",
              ", the row length a multiple of 16");
  return bf;
}

void check_avx512(const char* what) { TORCH_CHECK(peagle_ops::has_avx512(), what, ": this CPU has no AVX-512"); }

std::vector<torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor w, double eps) {
  check_avx512("rms_norm_forward");
  x = x.contiguous();
  const int64_t R = x.size(0), H = w.numel();
  const bool xb = rows_of(x, H, "rms_norm_forward x", false);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "rms_norm_forward: w [H] float32");
  auto y = torch::empty({R, H}, x.options().dtype(torch::kBFloat16));
  auto r = torch::empty({R}, x.options().dtype(torch::kFloat32));
  at::parallel_for(0, R, CHUNK, [&](int64_t r0, int64_t r1) {
    peagle_tops::rms_norm_fwd_avx512(x.data_ptr(), xb, w.data_ptr<float>(), (float)eps, H, r0, r1,
                                     (uint16_t*)y.data_ptr(), r.data_ptr<float>());
  });
  return {y, r};
}

std::vector<torch::Tensor> rms_norm_backward(torch::Tensor x, torch::Tensor w, torch::Tensor r, torch::Tensor g) {
  check_avx512("rms_norm_backward");
  x = x.contiguous();
  g = g.contiguous();
  const int64_t R = x.size(0), H = w.numel();
  const bool xb = rows_of(x, H, "rms_norm_backward x", false), gb = rows_of(g, H, "rms_norm_backward g", false);
  TORCH_CHECK(g.size(0) == R && r.numel() == R && r.scalar_type() == torch::kFloat32 && r.is_contiguous(),
              "rms_norm_backward: g [R, H] and r [R] float32 of the forward's rows");
  auto dx = torch::empty_like(x);
  const int64_t chunks = (R + CHUNK - 1) / CHUNK;
  auto part = torch::zeros({std::max<int64_t>(chunks, 1), H}, x.options().dtype(torch::kFloat32));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      peagle_tops::rms_norm_bwd_avx512(x.data_ptr(), xb, w.data_ptr<float>(), r.data_ptr<float>(), g.data_ptr(), gb,
                                       H, c * CHUNK, std::min(R, (c + 1) * CHUNK), dx.data_ptr(),
                                       part.data_ptr<float>() + c * H);
  });
  return {dx, part.sum(0)};
}

torch::Tensor swiglu_forward(torch::Tensor a, torch::Tensor b) {
  check_avx512("swiglu_forward");
  const int64_t R = a.size(0), I = a.size(1);
  rows_of(a, I, "swiglu_forward a", true);
  rows_of(b, I, "swiglu_forward b", true);
  TORCH_CHECK(b.size(0) == R, "swiglu_forward: a and b of one row count");
  auto h = torch::empty({R, I}, a.options());
  at::parallel_for(0, R, CHUNK, [&](int64_t r0, int64_t r1) {
    peagle_tops::swiglu_fwd_avx512((const uint16_t*)a.data_ptr(), a.stride(0), (const uint16_t*)b.data_ptr(),
                                   b.stride(0), I, r0, r1, (uint16_t*)h.data_ptr());
  });
  return h;
}

std::vector<torch::Tensor> swiglu_backward(torch::Tensor a, torch::Tensor b, torch::Tensor dh) {
  check_avx512("swiglu_backward");
  const int64_t R = a.size(0), I = a.size(1);
  rows_of(a, I, "swiglu_backward a", true);
  rows_of(b, I, "swiglu_backward b", true);
  dh = dh.contiguous();
  rows_of(dh, I, "swiglu_backward dh", true);
  TORCH_CHECK(b.size(0) == R && dh.size(0) == R, "swiglu_backward: a, b and dh of one row count");
  auto da = torch::empty({R, I}, a.options()), db = torch::empty({R, I}, a.options());
  at::parallel_for(0, R, CHUNK, [&](int64_t r0, int64_t r1) {
    peagle_tops::swiglu_bwd_avx512((const uint16_t*)a.data_ptr(), a.stride(0), (const uint16_t*)b.data_ptr(),
                                   b.stride(0), (const uint16_t*)dh.data_ptr(), I, r0, r1, (uint16_t*)da.data_ptr(),
                                   (uint16_t*)db.data_ptr());
  });
  return {da, db};
}

}  // namespace

void bind_train_ops(py::module& m) {
  m.def("rms_norm_forward", &rms_norm_forward, "training RMSNorm: (y bfloat16, 1/rms per row)", py::arg("x"),
        py::arg("w"), py::arg("eps"));
  m.def("rms_norm_backward", &rms_norm_backward, "training RMSNorm's gradients (dx, dw)", py::arg("x"), py::arg("w"),
        py::arg("r"), py::arg("g"));
  m.def("swiglu_forward", &swiglu_forward, "silu(a) * b in bfloat16", py::arg("a"), py::arg("b"));
  m.def("swiglu_backward", &swiglu_backward, "the gradients (da, db) of silu(a) * b", py::arg("a"), py::arg("b"),
        py::arg("dh"));
}
