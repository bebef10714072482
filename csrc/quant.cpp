// Python binding of peagle's quantized linear kernels (csrc/quant_kernels.h) and a few fused elementwise ops.
// Built by `make setup` (peagle/models/quant_ext.py, torch.utils.cpp_extension); peagle falls back to
// peagle/models/quant.py's torch code when it is missing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attend_impl.h"
#include "quant_kernels.h"

namespace pq = peagle_quant;
namespace pa = peagle_attend;
namespace peagle_attend {
// attend(a, t0, t1) computes tasks t0..t1-1 of tasks(a) (each path's own split of the queries)
namespace avx2 { int64_t tasks(const AttnArgs& a); void attend(const AttnArgs& a, int64_t t0, int64_t t1); }
namespace generic { int64_t tasks(const AttnArgs& a); void attend(const AttnArgs& a, int64_t t0, int64_t t1); }
}  // namespace peagle_attend

static bool cpu_has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

static void check_weight(const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  TORCH_CHECK(qtype == pq::Q4_0 || qtype == pq::Q4_1 || qtype == pq::Q8_0, "unsupported qtype ", qtype);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2,
              "w must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(w.size(0) == N && w.size(1) == K / 32 * pq::block_bytes(qtype), "w has shape ", w.sizes(),
              ", expected [", N, ", ", K / 32 * pq::block_bytes(qtype), "]");
}

static void check_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be a float32 CPU tensor");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
}

// impl: 0 = best for this CPU, 1 = scalar, 2 = AVX2 (error when the CPU lacks it).
torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N, int64_t K, int64_t impl) {
  check_weight(w, qtype, N, K);
  check_input(x, K);
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  TORCH_CHECK(impl != 2 || cpu_has_avx2(), "this CPU has no AVX2+FMA+F16C");
  pq::LinearFn fn = (impl == 2 || (impl == 0 && cpu_has_avx2())) ? pq::avx2::linear_rows : pq::scalar::linear_rows;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rb = w.size(1);
  // tasks of whole groups of 4 outputs (an output is computed whole by one thread: the split changes nothing)
  const int64_t groups = (N + 3) / 4, grain = std::max<int64_t>(1, 4096 / K);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(4 * K);
    fn(qtype, wp, rb, xp, M, K, yp, N, 4 * g0, std::min(4 * g1, N), buf.data());
  });
  return y.view(sizes);
}

// pack_a8's layout of w (quant_kernels.h): what the AVX2 a8 path reads.
torch::Tensor pack_a8(torch::Tensor w, int64_t qtype, int64_t N, int64_t K) {
  check_weight(w, qtype, N, K);
  auto out = torch::empty({(N + 7) / 8, K / 32 * pq::a8_group_block_bytes(qtype)}, torch::kUInt8);
  pq::pack_a8(qtype, w.data_ptr<uint8_t>(), N, K, out.data_ptr<uint8_t>());
  return out;
}

// y = x @ W^T with x quantized to 8 bits per block of 32 first (quant_kernels.h: llama.cpp's arithmetic). The
// scalar path reads w (GGUF's blocks), the AVX2 path packed (pack_a8 of w); both give the same bits.
torch::Tensor qlinear_a8(torch::Tensor x, torch::Tensor w, torch::Tensor packed, int64_t qtype, int64_t N,
                         int64_t K, int64_t impl) {
  check_weight(w, qtype, N, K);
  check_input(x, K);
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), nb = K / 32, G = (N + 7) / 8;
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  TORCH_CHECK(impl != 2 || cpu_has_avx2(), "this CPU has no AVX2+FMA+F16C");
  const bool vec = impl == 2 || (impl == 0 && cpu_has_avx2());
  if (vec)
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2 &&
                packed.size(0) == G && packed.size(1) == nb * pq::a8_group_block_bytes(qtype),
                "packed is not pack_a8 of this weight");
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  (vec ? pq::avx2::quantize_act : pq::quantize_act)(x2.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
  float* yp = y.data_ptr<float>();
  if (vec) {
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    at::parallel_for(0, G, std::max<int64_t>(1, 2048 / K), [&](int64_t g0, int64_t g1) {
      pq::avx2::linear_groups_a8(qtype, pp, xq.data(), xd.data(), xs.data(), M, K, yp, N, g0, g1);
    });
  } else {
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const int64_t rb = w.size(1);
    at::parallel_for(0, N, std::max<int64_t>(1, 8192 / K), [&](int64_t n0, int64_t n1) {
      pq::scalar::linear_rows_a8(qtype, wp, rb, xq.data(), xd.data(), xs.data(), M, K, yp, N, n0, n1);
    });
  }
  return y.view(sizes);
}

// The 8-bit activations the a8 products use: (xq int8 [M, K], xd [M, K/32], xs [M, K/32]) (tests).
std::vector<torch::Tensor> quantize_act(torch::Tensor x, int64_t impl) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) % 32 == 0, "quantize_act: [M, K%32]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, torch::kInt8);
  auto d = torch::empty({M, K / 32}, torch::kFloat32), s = torch::empty({M, K / 32}, torch::kFloat32);
  TORCH_CHECK(impl != 2 || cpu_has_avx2(), "this CPU has no AVX2+FMA+F16C");
  const bool vec = impl == 2 || (impl == 0 && cpu_has_avx2());
  (vec ? pq::avx2::quantize_act : pq::quantize_act)(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(),
                                                    d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d, s};
}

// The float32 weight [N, K] the kernels compute with (bit-exact).
torch::Tensor dequantize(torch::Tensor w, int64_t qtype, int64_t N, int64_t K) {
  check_weight(w, qtype, N, K);
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
  auto xc = x.contiguous(), hc = h.contiguous(), wc = weight.contiguous();
  auto res = torch::empty_like(xc), out = torch::empty_like(xc);
  const int64_t R = xc.numel() / H;
  const float *xp = xc.data_ptr<float>(), *hp = hc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *rp = res.data_ptr<float>(), *op = out.data_ptr<float>();
  const float e = (float)eps;
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float *a = xp + r * H, *b = hp + r * H;
      float* s = rp + r * H;
      double ss = 0.0;
      for (int64_t i = 0; i < H; i++) {
        s[i] = a[i] + b[i];
        ss += (double)s[i] * (double)s[i];
      }
      const float inv = (float)(1.0 / std::sqrt(ss / (double)H + (double)e));
      float* o = op + r * H;
      for (int64_t i = 0; i < H; i++) o[i] = (s[i] * inv) * wp[i];
    }
  });
  return {res, out};
}

// silu(gu[..., :I]) * gu[..., I:] for gu [..., 2I] float32.
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat32 && gu.size(-1) % 2 == 0, "silu_mul: float32 [..., 2I]");
  auto g = gu.contiguous();
  const int64_t I = g.size(-1) / 2, R = g.numel() / (2 * I);
  auto sizes = g.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, g.options());
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool vec = cpu_has_avx2();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float *a = gp + r * 2 * I, *b = a + I;
      float* o = op + r * I;
      if (vec) {
        pq::avx2::silu_mul(a, b, o, I);
        continue;
      }
      for (int64_t i = 0; i < I; i++) o[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
    }
  });
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
  TORCH_CHECK(kc.scalar_type() == torch::kFloat32 && vc.scalar_type() == torch::kFloat32 && kc.is_contiguous() &&
              vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.size(1) == nkv && b0 + B <= kc.size(0),
              "rope_kv: caches");
  auto c = cos.contiguous(), sn = sin.contiguous(), p = pos.to(torch::kLong).contiguous();
  TORCH_CHECK(c.numel() == B * T * hd && sn.numel() == B * T * hd && p.numel() == B * T, "rope_kv: cos/sin/pos");
  auto q = torch::empty({B, T, nh, hd}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const int64_t* pp = p.data_ptr<int64_t>();
  float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const int64_t W = (nh + 2 * nkv) * hd;
  for (int64_t bt = 0; bt < B * T; bt++)
    TORCH_CHECK(pp[bt] >= 0 && pp[bt] < cap, "rope_kv: position ", pp[bt], " outside the cache's ", cap);
  at::parallel_for(0, B * T, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t bt = r0; bt < r1; bt++) {
      const float *x = xp + bt * W, *cs = cp + bt * hd, *sv = sp + bt * hd;
      const int64_t b = bt / T;
      for (int64_t h = 0; h < nh + nkv; h++) {
        const float* xh = x + h * hd;
        float* o = h < nh ? qp + (bt * nh + h) * hd : kp + (((b0 + b) * nkv + (h - nh)) * cap + pp[bt]) * hd;
        for (int64_t i = 0; i < half; i++) o[i] = xh[i] * cs[i] + (-xh[i + half]) * sv[i];
        for (int64_t i = half; i < hd; i++) o[i] = xh[i] * cs[i] + xh[i - half] * sv[i];
      }
      for (int64_t h = 0; h < nkv; h++)
        std::copy(x + (nh + nkv + h) * hd, x + (nh + nkv + h + 1) * hd,
                  vp + (((b0 + b) * nkv + h) * cap + pp[bt]) * hd);
    }
  });
  return q;
}

// Block- and batch-invariant attention (attend_impl.h): q [B, T, nh, hd]; k, v [B, nkv, S, hd] (any strides but
// the last); mask None (every key visible) or bool [1 or B, 1, T, S] (True: visible). Returns [B, T, nh * hd].
// impl: 0 = best for this CPU, 1 = generic, 2 = AVX2.
torch::Tensor attend_exact(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                           double scale, int64_t impl) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend_exact: CPU tensors");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32 && q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attend_exact: float32 q [B,T,nh,hd], k/v [B,nkv,S,hd]");
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
    a.mask = m.data_ptr<bool>();
    a.msb = m.stride(0);
    a.mst = m.stride(2);
  }
  auto out = torch::empty({B, T, nh * hd}, qc.options());
  a.q = qc.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.B = B; a.T = T; a.nh = nh; a.nkv = nkv; a.hd = hd; a.S = S;
  a.ksb = k.stride(0); a.ksg = k.stride(1); a.ksj = k.stride(2);
  a.scale = (float)scale;
  TORCH_CHECK(impl != 2 || cpu_has_avx2(), "this CPU has no AVX2+FMA");
  const bool vec = impl == 2 || (impl == 0 && cpu_has_avx2());
  auto fn = vec ? pa::avx2::attend : pa::generic::attend;
  const int64_t n = (vec ? pa::avx2::tasks : pa::generic::tasks)(a);
  const int64_t grain = std::max<int64_t>(1, 16384 * n / std::max<int64_t>(1, B * T * nh * S * hd));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) { fn(a, i0, i1); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_exact", &attend_exact, "attention summed in one fixed order per query (batch/block-invariant)");
  m.def("rope_kv", &rope_kv, "RoPE of q and k and the k/v cache write in one pass; returns q");
  m.def("qlinear", &qlinear, "y = x @ W^T, W in GGUF blocks (Q4_0/Q4_1/Q8_0), batch-invariant");
  m.def("qlinear_a8", &qlinear_a8, "y = q8(x) @ W^T: activations quantized to 8 bits per block (llama.cpp's)");
  m.def("pack_a8", &pack_a8, "w's blocks reordered for the AVX2 a8 products (groups of 8 outputs)");
  m.def("quantize_act", &quantize_act, "x's 8-bit blocks as the a8 products use them", py::arg("x"),
        py::arg("impl") = 0);
  m.def("dequantize", &dequantize, "the float32 weight the kernels use");
  m.def("add_rms_norm", &add_rms_norm, "(x + h, rms_norm(x + h) * w)");
  m.def("silu_mul", &silu_mul, "silu(a) * b of gu = [a, b]");
  m.def("has_avx2", &cpu_has_avx2, "AVX2 + FMA + F16C on this CPU");
}
