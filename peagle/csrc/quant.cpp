// Python binding of peagle's quantized linear kernels (csrc/quant_kernels.h) and a few fused elementwise ops.
// Built by `make setup` (peagle/models/quant_ext.py, torch.utils.cpp_extension); peagle falls back to
// peagle/models/quant.py's torch code when it is missing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "quant_kernels.h"

namespace pq = peagle_quant;
namespace pa = peagle_attend;
namespace po = peagle_ops;

static bool cpu_has_avx2() { return po::has_avx2(); }
void bind_forward(py::module& m);   // forward.cpp
void bind_draft_kl(py::module& m);  // draft_kl.cpp
void bind_train_attn(py::module& m);  // train_attn.cpp
void bind_transpose(py::module& m);   // transpose.cpp
void bind_train_ops(py::module& m);   // train_ops.cpp
void bind_argmax(py::module& m);      // argmax.cpp
void bind_draft_pass(py::module& m);  // draft_pass.cpp

// F32 (qtype 0, packed by 8) is a weight of the float-activation product (qlinear) only.
static void check_weight(const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool f32_ok = true) {
  TORCH_CHECK(qtype == pq::Q4_0 || qtype == pq::Q4_1 || qtype == pq::Q8_0 || (f32_ok && qtype == pq::F32),
              "unsupported qtype ", qtype);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2,
              "w must be a contiguous 2-D uint8 CPU tensor");
  const int64_t rows = pq::stored_rows((int)qtype, N);
  TORCH_CHECK(w.size(0) == rows && w.size(1) == K / 32 * pq::block_bytes(qtype), "w has shape ", w.sizes(),
              ", expected [", rows, ", ", K / 32 * pq::block_bytes(qtype), "]");
}

static void check_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be a float32 CPU tensor");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
}

// pack_a8's layout of a [N, K] weight of qtype, or an empty tensor (none given).
static bool check_packed(const torch::Tensor& packed, int64_t qtype, int64_t N, int64_t K) {
  if (!packed.defined() || packed.numel() == 0) return false;
  TORCH_CHECK(qtype != pq::F32 && packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 &&
                  packed.is_contiguous() && packed.dim() == 2 && packed.size(0) == (N + 7) / 8 &&
                  packed.size(1) == K / 32 * pq::a8_group_block_bytes(qtype),
              "packed is not pack_a8 of this weight");
  return true;
}

// impl: 0 = best for this CPU, 1 = scalar, 2 = AVX2, 3 = AVX-512, 4 = AMX (error when the CPU lacks it). packed:
// pack_a8 of a block-type w (the AVX-512 path's layout), or none / an empty tensor (that path then takes AVX2's).
torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N, int64_t K, int64_t impl,
                      c10::optional<torch::Tensor> packed_opt) {
  check_weight(w, qtype, N, K);
  check_input(x, K);
  const torch::Tensor packed = packed_opt.value_or(torch::Tensor());
  const bool has = check_packed(packed, qtype, N, K);
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, K}).contiguous();
  sizes.back() = N;
  auto y = torch::empty({x2.size(0), N}, x.options());
  po::qlinear(x2.data_ptr<float>(), x2.size(0), K, w.data_ptr<uint8_t>(), has ? packed.data_ptr<uint8_t>() : nullptr,
              (int)qtype, N, impl, y.data_ptr<float>());
  return y.view(sizes);
}

// pack_a8's layout of w (quant_kernels.h): what the vector a8 paths and AVX-512's float-activation path read.
torch::Tensor pack_a8(torch::Tensor w, int64_t qtype, int64_t N, int64_t K) {
  check_weight(w, qtype, N, K, false);
  auto out = torch::empty({(N + 7) / 8, K / 32 * pq::a8_group_block_bytes(qtype)}, torch::kUInt8);
  pq::pack_a8(qtype, w.data_ptr<uint8_t>(), N, K, out.data_ptr<uint8_t>());
  return out;
}

// y = x @ W^T with x quantized to 8 bits per block of 32 first (quant_kernels.h: llama.cpp's arithmetic). The
// scalar path reads w (GGUF's blocks), the AVX2 path packed (pack_a8 of w); both give the same bits.
torch::Tensor qlinear_a8(torch::Tensor x, torch::Tensor w, torch::Tensor packed, int64_t qtype, int64_t N,
                         int64_t K, int64_t impl) {
  check_weight(w, qtype, N, K, false);
  check_input(x, K);
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), nb = K / 32;
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  if (po::use_avx2(impl)) TORCH_CHECK(check_packed(packed, qtype, N, K), "packed is not pack_a8 of this weight");
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  po::qlinear_a8(x2.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), (int)qtype, N, impl,
                 {xq.data(), xd.data(), xs.data()}, y.data_ptr<float>());
  return y.view(sizes);
}

// The 8-bit activations the a8 products use: (xq int8 [M, K], xd [M, K/32], xs [M, K/32]) (tests).
std::vector<torch::Tensor> quantize_act(torch::Tensor x, int64_t impl) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) % 32 == 0, "quantize_act: [M, K%32]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, torch::kInt8);
  auto d = torch::empty({M, K / 32}, torch::kFloat32), s = torch::empty({M, K / 32}, torch::kFloat32);
  const bool vec = po::use_avx2(impl);   // the AVX-512 path quantizes as AVX2's
  (vec ? pq::avx2::quantize_act : pq::quantize_act)(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(),
                                                    d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d, s};
}

// The float32 weight [N, K] the kernels compute with (bit-exact).
torch::Tensor dequantize(torch::Tensor w, int64_t qtype, int64_t N, int64_t K) {
  check_weight(w, qtype, N, K, false);
  auto out = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) pq::scalar::dequant_row(qtype, wp + n * rb, K, op + n * K);
  });
  return out;
}

// x + h (the new residual) and rms_norm(x + h) * weight, in one pass over each row. x, h: [..., H] float32.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor h, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && h.scalar_type() == torch::kFloat32 &&
              weight.scalar_type() == torch::kFloat32 && x.sizes() == h.sizes(), "add_rms_norm: float32, same shapes");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H, "add_rms_norm: x, h [..., H], weight [H]");
  auto xc = x.contiguous(), hc = h.contiguous(), wc = weight.contiguous();
  auto res = torch::empty_like(xc), out = torch::empty_like(xc);
  if (xc.numel() == 0) return {res, out};
  po::add_rms_norm(xc.data_ptr<float>(), hc.data_ptr<float>(), wc.data_ptr<float>(), xc.numel() / H, H, (float)eps,
                   res.data_ptr<float>(), out.data_ptr<float>());
  return {res, out};
}

// rms_norm(x) * weight per row of x [..., H] float32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32 &&
              weight.numel() == x.size(-1), "rms_norm: float32 x [..., H], weight [H]");
  const int64_t H = x.size(-1);
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  if (xc.numel() == 0) return out;
  po::rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), xc.numel() / H, H, (float)eps, out.data_ptr<float>());
  return out;
}

// silu(gu[..., :I]) * gu[..., I:] for gu [..., 2I] float32.
torch::Tensor silu_mul(torch::Tensor gu, int64_t impl) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat32 && gu.size(-1) % 2 == 0, "silu_mul: float32 [..., 2I]");
  auto g = gu.contiguous();
  const int64_t I = g.size(-1) / 2;
  auto sizes = g.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, g.options());
  if (out.numel() == 0) return out;
  po::silu_mul(g.data_ptr<float>(), g.numel() / (2 * I), I, out.data_ptr<float>(), impl);
  return out;
}

// RoPE (rotate-half: x * cos + rot * sin, rot = [-x2, x1], the same three roundings per element as the torch
// ops) of q and k, and the cache write of k and v, in one pass. qkv [B, T, (nh + 2 nkv) * hd] float32 contiguous;
// cos, sin [B, T, hd]; kc, vc [rows, nkv, cap, hd] float32 contiguous; pos [B, T] int64 (< cap). Rows b0..b0+B-1 of
// the cache get k (rotated) and v at their positions; returns q rotated [B, T, nh, hd].
torch::Tensor rope_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc, torch::Tensor vc,
                      int64_t b0, torch::Tensor pos, int64_t nh, int64_t nkv) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous() && qkv.dim() == 3, "rope_kv: qkv");
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = kc.size(3), half = hd / 2, cap = kc.size(2);
  TORCH_CHECK(qkv.size(2) == (nh + 2 * nkv) * hd && hd % 2 == 0, "rope_kv: qkv width");
  const bool bf16 = kc.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || kc.scalar_type() == torch::kFloat32) && vc.scalar_type() == kc.scalar_type() &&
              kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.dim() == 4 &&
              kc.size(1) == nkv && b0 >= 0 && b0 + B <= kc.size(0), "rope_kv: caches (float32 or bfloat16)");
  auto c = cos.contiguous(), sn = sin.contiguous(), p = pos.to(torch::kLong).contiguous();
  TORCH_CHECK(c.numel() == B * T * hd && sn.numel() == B * T * hd && p.numel() == B * T, "rope_kv: cos/sin/pos");
  auto q = torch::empty({B, T, nh, hd}, qkv.options());
  const int64_t* pp = p.data_ptr<int64_t>();
  for (int64_t bt = 0; bt < B * T; bt++)
    TORCH_CHECK(pp[bt] >= 0 && pp[bt] < cap, "rope_kv: position ", pp[bt], " outside the cache's ", cap);
  po::rope_kv(qkv.data_ptr<float>(), c.data_ptr<float>(), sn.data_ptr<float>(), pp, B, T, nh, nkv, hd,
              kc.data_ptr(), vc.data_ptr(), bf16, cap, b0, q.data_ptr<float>());
  return q;
}

// The KV compaction after a tree step (peagle/tree.py, compact_kv) over every layer in one call: per layer k, v
// [rows, nkv, cap, hd] float32 or bfloat16, contiguous; rows b0..b0+B-1; start [B], path [B, W] int64 (slots checked).
void compact_kv(std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs, int64_t b0, torch::Tensor start,
                torch::Tensor path) {
  TORCH_CHECK(ks.size() == vs.size() && path.dim() == 2 && start.dim() == 1 && start.size(0) == path.size(0),
              "compact_kv: k and v per layer, start [B], path [B, W]");
  auto st = start.to(torch::kLong).contiguous(), pt = path.to(torch::kLong).contiguous();
  const int64_t B = pt.size(0), W = pt.size(1);
  const int64_t *sp = st.data_ptr<int64_t>(), *pp = pt.data_ptr<int64_t>();
  for (size_t l = 0; l < ks.size(); l++) {
    auto &k = ks[l], &v = vs[l];
    TORCH_CHECK((k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) && k.is_contiguous() &&
                v.is_contiguous() && k.dim() == 4 && k.sizes() == v.sizes() && v.scalar_type() == k.scalar_type() &&
                b0 >= 0 && b0 + B <= k.size(0), "compact_kv: caches [rows, nkv, cap, hd] float32 or bfloat16");
    const int64_t cap = k.size(2);
    for (int64_t b = 0; b < B; b++)
      for (int64_t i = 0; i < W; i++)      // compared without overflow: sp + max(i, path) < cap
        TORCH_CHECK(sp[b] >= 0 && pp[b * W + i] >= 0 && pp[b * W + i] < cap && sp[b] < cap - std::max(i, pp[b * W + i]),
                    "compact_kv: slot outside the cache");
    po::compact_kv((char*)k.data_ptr(), (char*)v.data_ptr(), k.element_size(), k.size(1), cap, k.size(3), b0, B, sp,
                   pp, W);
  }
}

// Block- and batch-invariant attention (attend_impl.h): q [B, T, nh, hd]; k, v [B, nkv, S, hd] (any strides but
// the last; float32, or both bfloat16: a bfloat16 KV cache); mask None (every key visible) or bool [1 or B, 1, T,
// S] (True: visible). Returns [B, T, nh * hd].
// impl: 0 = best for this CPU, 1 = generic, 2 = AVX2, 3 or 4 = AVX-512 (two queries per register).
torch::Tensor attend_exact(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                           double scale, int64_t impl) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend_exact: CPU tensors");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 &&
                  (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attend_exact: float32 q [B,T,nh,hd], k/v [B,nkv,S,hd] (float32 or bfloat16)");
  auto qc = q.contiguous();
  const int64_t B = qc.size(0), T = qc.size(1), nh = qc.size(2), hd = qc.size(3), nkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == hd && v.sizes() == k.sizes() && k.strides() == v.strides() &&
              k.stride(3) == 1 && nkv > 0 && nh % nkv == 0 && hd % 8 == 0, "attend_exact: k/v shapes or strides");
  pa::AttnArgs a{};
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == torch::kBool && m.device().is_cpu(), "attend_exact: a bool CPU mask");
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && m.size(2) == T && m.size(3) == S,
                "attend_exact: mask [1 or B, 1, T, S]");
    m = m.expand({B, 1, T, S});
    if (m.stride(3) != 1) m = m.contiguous();
    a.mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());   // bytes: any nonzero is visible
    a.msb = m.stride(0);
    a.mst = m.stride(2);
  }
  auto out = torch::empty({B, T, nh * hd}, qc.options());
  a.q = qc.data_ptr<float>();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.kv_bf16 = k.scalar_type() == torch::kBFloat16;
  a.out = out.data_ptr<float>();
  a.B = B; a.T = T; a.nh = nh; a.nkv = nkv; a.hd = hd; a.S = S;
  a.ksb = k.stride(0); a.ksg = k.stride(1); a.ksj = k.stride(2);
  a.scale = (float)scale;
  po::attend(a, impl);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  po::has_amx();   // the AMX probe (it briefly handles SIGILL / SIGSEGV) at import, not inside a later product
  m.def("attend_exact", &attend_exact, "attention summed in one fixed order per query (batch/block-invariant)");
  m.def("rope_kv", &rope_kv, "RoPE of q and k and the k/v cache write in one pass; returns q");
  m.def("qlinear", &qlinear, "y = x @ W^T, W in GGUF blocks (Q4_0/Q4_1/Q8_0) or float32 packed by 8 (F32), batch-invariant",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("N"), py::arg("K"), py::arg("impl"),
        py::arg("packed") = py::none());
  m.def("qlinear_a8", &qlinear_a8, "y = q8(x) @ W^T: activations quantized to 8 bits per block (llama.cpp's)");
  m.def("pack_a8", &pack_a8, "w's blocks reordered for the a8 products and AVX-512's float ones (groups of 8 outputs)");
  m.def("quantize_act", &quantize_act, "x's 8-bit blocks as the a8 products use them", py::arg("x"),
        py::arg("impl") = 0);
  m.def("dequantize", &dequantize, "the float32 weight the kernels use");
  m.def("add_rms_norm", &add_rms_norm, "(x + h, rms_norm(x + h) * w)");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * w");
  m.def("compact_kv", &compact_kv, "a tree step's KV compaction over every layer");
  m.def("silu_mul", &silu_mul, "silu(a) * b of gu = [a, b]", py::arg("gu"), py::arg("impl") = 0);
  m.def("has_avx2", &cpu_has_avx2, "AVX2 + FMA + F16C on this CPU");
  m.def("has_avx512", &po::has_avx512, "AVX-512 F/VL/BW/DQ + VNNI on this CPU (impl 3)");
  m.def("has_amx_bf16", &po::has_amx_bf16, "AMX-BF16 usable here, with has_amx (training attention's scores)");
  m.def("has_amx", &po::has_amx, "AMX-TILE + AMX-INT8 usable here, with AVX-512 (impl 4)");
  m.def("set_avx512_min_rows", &po::set_avx512_min_rows, "impl 0 takes AVX-512 from this many rows (ops.h)",
        py::arg("qtype"), py::arg("act8"), py::arg("rows"));
  m.def("avx512_min_rows", &po::avx512_min_rows, "impl 0's AVX-512 threshold (ops.h)", py::arg("qtype"),
        py::arg("act8"));
  m.def("set_avx2_vnni", &po::set_avx2_vnni, "the AVX2 path's 8-bit products through dpbusd on ymm (ops.h)",
        py::arg("on"));
  m.def("avx2_vnni", &po::avx2_vnni, "whether the AVX2 path's 8-bit products take dpbusd on ymm (ops.h)");
  m.def("product_impl", &po::product_impl, "the path a product of M rows takes (ops.h)", py::arg("impl"),
        py::arg("qtype"), py::arg("act8"), py::arg("M"));
  bind_forward(m);
  bind_argmax(m);
  bind_draft_pass(m);
  bind_draft_kl(m);
  bind_train_attn(m);
  bind_transpose(m);
  bind_train_ops(m);
}
