// Python binding of the transposing copy (transpose.h): column tiles split over threads, AVX-512 only;
// peagle/train/train_linear.py transposes with torch where the CPU has no AVX-512.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "transpose.h"

// [C, rows_pad] (float32 or bfloat16) = src^T, src [R, C] float32 or bfloat16 contiguous, zero from row R.
static torch::Tensor transpose_pad(torch::Tensor src, int64_t rows_pad, bool to_float32) {
  TORCH_CHECK(peagle_ops::has_avx512(), "transpose_pad: this CPU has no AVX-512");
  const bool bf = src.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(src.device().is_cpu() && (bf || src.scalar_type() == torch::kFloat32) && src.dim() == 2 &&
                  src.is_contiguous(), "transpose_pad: src [R, C] float32 or bfloat16, contiguous");
  const int64_t R = src.size(0), C = src.size(1);
  TORCH_CHECK(C % 16 == 0 && rows_pad % 16 == 0 && rows_pad >= R,
              "transpose_pad: C and rows_pad multiples of 16, rows_pad >= R");
  auto dst = torch::empty({C, rows_pad}, src.options().dtype(to_float32 ? torch::kFloat32 : torch::kBFloat16));
  const void* s = src.data_ptr();
  void* d = dst.data_ptr();
  at::parallel_for(0, C / 16, 1, [&](int64_t t0, int64_t t1) {
    peagle_transpose::transpose_avx512(s, bf, R, C, d, !to_float32, rows_pad, t0 * 16, t1 * 16);
  });
  return dst;
}

void bind_transpose(py::module& m) {
  m.def("transpose_pad", &transpose_pad, "src^T with rows zero-padded (float32 / bfloat16 in and out)",
        py::arg("src"), py::arg("rows_pad"), py::arg("to_float32"));
}
