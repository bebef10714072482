// A quantized (or CPU float32: F32) target's layers in one call (peagle/models/llama.py, Transformer._forward_fused): the same ops in
// the same order on the same bits (ops.h), without a Python round trip and a fresh tensor per op. Built once per
// target with its weights (LayerStack); forward() takes a block's embeddings, positions and the KV cache.
//
// Per layer i (h: the normed residual, x: the residual stream; the first h is rms_norm(x + 0) with ln1 of 0):
//   qkv = h @ Wqkv; q = rope(q), cache <- rope(k), v; a = attend(q, cache); x, h = x + a @ Wo, norm2(.)
//   gu = h @ Wgu; d = silu(gu[:I]) * gu[I:] @ Wdown; x, h = x + d, norm1 of layer i + 1 (the last: final norm)
// Returns the final h [B, T, H] and the residual entering each layer of aux_ids ([B, T, n * H], layer order).
// A drafter head (peagle/heads/model.py) runs here too: its layer 0 reads its own input h0 ([norm(embedding) ||
// norm(hidden)], 2H wide) instead of rms_norm(x), and x is its residual as given.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "quant_kernels.h"

namespace pq = peagle_quant;
namespace po = peagle_ops;

namespace {

struct Proj {
  // GGUF blocks [N, K/32 * block bytes] (or F32 packed by 8); pack_a8 of the blocks where a path reads it (8-bit
  // activations: always; float ones: the AVX-512 path), else undefined
  torch::Tensor w, packed;
  int qtype;
  int64_t N, K;
  bool act8;   // the products quantize the activations to 8 bits (s8: scratch for M rows of at least K)
  // out[M, N] = in[M, K] @ W^T
  void run(const float* in, int64_t M, float* out, int64_t impl, const po::Act8& s8) const {
    if (act8)
      po::qlinear_a8(in, M, K, w.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), qtype, N, impl, s8, out);
    else
      po::qlinear(in, M, K, w.data_ptr<uint8_t>(), packed.defined() ? packed.data_ptr<uint8_t>() : nullptr, qtype,
                  N, impl, out);
  }
};

// A product's weight: w of qtype for N x K (checked by the caller), packed (pack_a8 of it, checked as qlinear's by
// quant.cpp's check_packed, or an empty tensor: none; 8-bit activations need it).
Proj make_proj(torch::Tensor w, torch::Tensor packed, int qtype, int64_t N, int64_t K, bool act8, const char* who) {
  const bool has = check_packed(packed, qtype, N, K);
  TORCH_CHECK(has || !act8, who, ": 8-bit activations read pack_a8 of the weight");
  return {w, has ? packed : torch::Tensor(), qtype, N, K, act8};
}

class LayerStack {
 public:
  // w: 4 per layer (qkv, o, gate_up, down); packed: the same count (an empty tensor: none; act8 needs them) or
  // none at all; norms: 2 per layer (ln1, ln2) and the final norm.
  LayerStack(std::vector<torch::Tensor> w, std::vector<torch::Tensor> packed, bool act8, std::vector<int64_t> qtypes,
             std::vector<torch::Tensor> norms, int64_t nh, int64_t nkv, int64_t hd, double eps, int64_t impl)
      : nh_(nh), nkv_(nkv), hd_(hd), eps_((float)eps), impl_(impl), act8_(act8) {
    const int64_t n = (int64_t)w.size() / 4;
    TORCH_CHECK(nkv > 0 && nh % nkv == 0 && hd > 0 && hd % 8 == 0,
                "LayerStack: heads ", nh, " / ", nkv, " x head_dim ", hd, " (nh a multiple of nkv, hd of 8)");
    TORCH_CHECK(n >= 1 && (int64_t)w.size() == 4 * n && (int64_t)qtypes.size() == 4 * n &&
                    (packed.empty() || packed.size() == w.size()) && (int64_t)norms.size() == 2 * n + 1,
                "LayerStack: 4 weights, 4 qtypes, (4 packed) and 2 norms per layer, then the final norm");
    H_ = norms[0].numel();
    std::vector<int64_t> K(w.size());
    for (size_t j = 0; j < w.size(); j++) {
      const int qt = (int)qtypes[j], bb = pq::block_bytes(qt);
      TORCH_CHECK(bb > 0 && w[j].scalar_type() == torch::kUInt8 && w[j].dim() == 2 && w[j].is_contiguous() &&
                      w[j].size(1) % bb == 0 && !(act8_ && qt == pq::F32),
                  "LayerStack: weight ", j, " is not GGUF blocks (or F32 without 8-bit activations)");
      K[j] = w[j].size(1) / bb * 32;
    }
    for (size_t j = 0; j < w.size(); j++) {
      // outputs from the layer's shape (an F32 weight's stored rows are padded to a multiple of 8): qkv
      // (nh + 2 nkv) hd, o and down H, gate_up twice down's inputs
      const int qt = (int)qtypes[j];
      const int64_t N = j % 4 == 0 ? (nh + 2 * nkv) * hd : j % 4 == 2 ? 2 * K[j + 1] : H_;
      TORCH_CHECK(w[j].size(0) == pq::stored_rows(qt, N), "LayerStack: weight ", j, " has ", w[j].size(0),
                  " rows, its layer's shape ", N, " outputs");
      proj_.push_back(make_proj(w[j], packed.empty() ? torch::Tensor() : packed[j], qt, N, K[j], act8_, "LayerStack"));
    }
    for (int64_t i = 0; i < n; i++) {
      const Proj &qkv = proj_[4 * i], &o = proj_[4 * i + 1], &gu = proj_[4 * i + 2];
      TORCH_CHECK((qkv.K == H_ || i == 0) && o.K == nh * hd && gu.K == H_ && gu.N == proj_[2].N, "LayerStack: layer ",
                  i, " shapes (every layer's intermediate size the first's: the scratch is sized by it)");
    }
    for (auto& t : norms) {
      TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.numel() == H_, "LayerStack: norms of ", H_, " floats");
      norms_.push_back(t.contiguous());
    }
    I_ = proj_[2].N / 2;
  }

  int64_t layers() const { return (int64_t)proj_.size() / 4; }

  std::vector<torch::Tensor> forward(torch::Tensor x, std::vector<torch::Tensor> kc, std::vector<torch::Tensor> vc,
                                     torch::Tensor cos, torch::Tensor sin, torch::Tensor pos,
                                     c10::optional<torch::Tensor> mask, int64_t b0, int64_t S,
                                     std::vector<int64_t> aux_ids, c10::optional<torch::Tensor> h0) {
    const int64_t n = (int64_t)proj_.size() / 4;
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.size(2) == H_, "forward: x [B, T, H]");
    TORCH_CHECK((int64_t)kc.size() == n && (int64_t)vc.size() == n, "forward: one k and one v cache per layer");
    const int64_t B = x.size(0), T = x.size(1), M = B * T, H = H_, I = I_, hd = hd_;
    auto xc = x.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), p = pos.to(torch::kLong).contiguous();
    TORCH_CHECK(c.scalar_type() == torch::kFloat32 && sn.scalar_type() == torch::kFloat32 && c.numel() == M * hd &&
                    sn.numel() == M * hd && p.numel() == M, "forward: cos/sin [B, T, hd], pos [B, T]");
    const int64_t cap = kc[0].size(2);
    for (int64_t i = 0; i < n; i++)
      TORCH_CHECK((kc[i].scalar_type() == torch::kFloat32 || kc[i].scalar_type() == torch::kBFloat16) &&
                      kc[i].scalar_type() == kc[0].scalar_type() && vc[i].scalar_type() == kc[0].scalar_type() &&
                      kc[i].is_contiguous() && vc[i].is_contiguous() &&
                      kc[i].sizes() == vc[i].sizes() && kc[i].dim() == 4 && kc[i].size(1) == nkv_ &&
                      kc[i].size(2) == cap && kc[i].size(3) == hd && b0 >= 0 && b0 + B <= kc[i].size(0),
                  "forward: caches [rows, nkv, cap, hd], all float32 or all bfloat16");
    TORCH_CHECK(S >= 1 && S <= cap, "forward: span ", S, " outside the cache's ", cap);
    const int64_t* pp = p.data_ptr<int64_t>();
    for (int64_t j = 0; j < M; j++)
      TORCH_CHECK(pp[j] >= 0 && pp[j] < cap, "forward: position ", pp[j], " outside the cache's ", cap);
    torch::Tensor m;
    peagle_attend::AttnArgs a{};
    if (mask.has_value() && mask->defined()) {
      m = *mask;
      TORCH_CHECK(m.scalar_type() == torch::kBool && m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) &&
                      m.size(2) == T && m.size(3) == S, "forward: mask [1 or B, 1, T, S] bool");
      m = m.expand({B, 1, T, S});
      if (m.stride(3) != 1) m = m.contiguous();
      a.mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());   // bytes: any nonzero is visible
      a.msb = m.stride(0);
      a.mst = m.stride(2);
    }
    std::vector<bool> want(n + 1, false);
    int64_t naux = 0;
    for (int64_t id : aux_ids)
      if (id >= 0 && id <= n && !want[id]) want[id] = true, naux++;

    const int64_t K0 = proj_[0].K;   // layer 0's input width: H, or a drafter's 2H (h0)
    torch::Tensor in0;
    if (h0.has_value() && h0->defined()) {
      in0 = h0->contiguous();
      TORCH_CHECK(in0.scalar_type() == torch::kFloat32 && in0.numel() == M * K0, "forward: h0 [B, T, ", K0, "]");
    } else {
      TORCH_CHECK(K0 == H, "forward: layer 0 reads ", K0, " features: pass its input h0");
    }
    const int64_t Wq = (nh_ + 2 * nkv_) * hd, A = nh_ * hd, Kmax = std::max({H, A, I, K0});
    auto res = torch::empty({B, T, H}, xc.options()), h = torch::empty({B, T, H}, xc.options());
    auto aux = torch::empty({B, T, naux * H}, xc.options());
    std::vector<float> buf(M * (Wq + A + A + H + 2 * I + I + H));
    float *qkv = buf.data(), *q = qkv + M * Wq, *att = q + M * A, *o = att + M * A, *gu = o + M * H,
          *act = gu + M * 2 * I, *zeros = act + M * I;
    std::fill(zeros, zeros + M * H, 0.0f);
    std::vector<int8_t> xq(M * Kmax);
    std::vector<float> xd(M * Kmax / 32), xs(M * Kmax / 32);
    const po::Act8 s8{xq.data(), xd.data(), xs.data()};
    float *xr = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *ap = aux.data_ptr<float>();
    auto prod = [&](const Proj& w, const float* in, float* out) { w.run(in, M, out, impl_, s8); };
    int64_t slot = 0;
    auto keep = [&](int64_t i) {   // the residual entering layer i into its aux slot
      if (!want[i]) return;
      for (int64_t r = 0; r < M; r++) std::copy(xr + r * H, xr + (r + 1) * H, ap + (r * naux + slot) * H);
      slot++;
    };
    if (in0.defined()) std::copy(xc.data_ptr<float>(), xc.data_ptr<float>() + M * H, xr);
    else po::add_rms_norm(xc.data_ptr<float>(), zeros, norms_[0].data_ptr<float>(), M, H, eps_, xr, hp);
    a.q = q;
    a.out = att;
    a.B = B; a.T = T; a.nh = nh_; a.nkv = nkv_; a.hd = hd; a.S = S;
    a.ksb = nkv_ * cap * hd; a.ksg = cap * hd; a.ksj = hd;
    a.scale = (float)std::pow((double)hd, -0.5);   // Python's hd ** -0.5 (quant.attend_exact)
    a.kv_bf16 = kc[0].scalar_type() == torch::kBFloat16;
    const int64_t esize = kc[0].element_size();
    for (int64_t i = 0; i < n; i++) {
      keep(i);
      char *kp = (char*)kc[i].data_ptr(), *vp = (char*)vc[i].data_ptr();
      prod(proj_[4 * i], i == 0 && in0.defined() ? in0.data_ptr<float>() : hp, qkv);
      po::rope_kv(qkv, c.data_ptr<float>(), sn.data_ptr<float>(), pp, B, T, nh_, nkv_, hd, kp, vp, a.kv_bf16, cap, b0,
                  q);
      a.k = kp + b0 * a.ksb * esize;
      a.v = vp + b0 * a.ksb * esize;
      po::attend(a, impl_);
      prod(proj_[4 * i + 1], att, o);
      po::add_rms_norm(xr, o, norms_[2 * i + 1].data_ptr<float>(), M, H, eps_, xr, hp);
      prod(proj_[4 * i + 2], hp, gu);
      po::silu_mul(gu, M, I, act, impl_);
      prod(proj_[4 * i + 3], act, o);
      po::add_rms_norm(xr, o, norms_[i + 1 < n ? 2 * i + 2 : 2 * n].data_ptr<float>(), M, H, eps_, xr, hp);
    }
    keep(n);
    return {h, aux};
  }

 private:
  std::vector<Proj> proj_;
  std::vector<torch::Tensor> norms_;
  int64_t nh_, nkv_, hd_, H_ = 0, I_ = 0;
  float eps_;
  int64_t impl_;
  bool act8_;
};

// peagle/models/layers.py BlockCtx's per-forward facts in one call (each a torch op before, and after a step's
// weight stream each op pays its cache misses: lab/measure/step_glue.py): pos [B, T] = start[b] + i; pos_w, pos
// clamped to clamp_at (< 0: pos itself); cos / sin [B, T, 1, hd], the tables' rows at pos_w; with `masked`, the
// mask [B, 1, T, span]: key j visible to query i iff j <= pos and (window < 0 or j > pos - window). Integer
// facts and copied rows: the same values as the torch ops.
std::vector<torch::Tensor> block_ctx(torch::Tensor start, int64_t T, int64_t span, int64_t clamp_at, int64_t window,
                                     bool masked, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(start.device().is_cpu() && start.scalar_type() == torch::kLong && start.dim() == 1 && T >= 1 && span >= 1,
              "block_ctx: start [B] int64 on the CPU, T >= 1, span >= 1");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.dim() == 3 &&
                  cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "block_ctx: rope tables [n, 1, hd] float32, contiguous");
  const int64_t B = start.size(0), n = cos.size(0), hd = cos.size(2);
  auto st = start.contiguous();
  const int64_t* ps = st.data_ptr<int64_t>();
  auto pos = torch::empty({B, T}, st.options());
  int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < T; i++) pp[b * T + i] = ps[b] + i;
  auto pos_w = pos;
  if (clamp_at >= 0) {
    pos_w = torch::empty({B, T}, st.options());
    int64_t* pw = pos_w.data_ptr<int64_t>();
    for (int64_t j = 0; j < B * T; j++) pw[j] = std::min(pp[j], clamp_at);
  }
  const int64_t* pw = pos_w.data_ptr<int64_t>();
  auto c = torch::empty({B, T, 1, hd}, cos.options()), sn = torch::empty({B, T, 1, hd}, sin.options());
  const float *tc = cos.data_ptr<float>(), *ts = sin.data_ptr<float>();
  float *oc = c.data_ptr<float>(), *os = sn.data_ptr<float>();
  for (int64_t j = 0; j < B * T; j++) {
    TORCH_CHECK(pw[j] >= 0 && pw[j] < n, "block_ctx: position ", pw[j], " outside the rope tables' ", n);
    std::copy(tc + pw[j] * hd, tc + (pw[j] + 1) * hd, oc + j * hd);
    std::copy(ts + pw[j] * hd, ts + (pw[j] + 1) * hd, os + j * hd);
  }
  std::vector<torch::Tensor> out{pos, pos_w, c, sn};
  if (masked) {
    auto m = torch::empty({B, 1, T, span}, st.options().dtype(torch::kBool));
    bool* pm = m.data_ptr<bool>();
    for (int64_t j = 0; j < B * T; j++)
      for (int64_t k = 0; k < span; k++) pm[j * span + k] = k <= pp[j] && (window < 0 || k > pp[j] - window);
    out.push_back(m);
  }
  return out;
}

}  // namespace

void bind_forward(py::module& m) {
  m.def("block_ctx", &block_ctx, "a forward's positions, rope rows and mask (peagle/models/layers.py BlockCtx)",
        py::arg("start"), py::arg("T"), py::arg("span"), py::arg("clamp_at"), py::arg("window"), py::arg("masked"),
        py::arg("cos"), py::arg("sin"));
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, bool, std::vector<int64_t>,
                    std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double, int64_t>())
      .def("forward", &LayerStack::forward, py::arg("x"), py::arg("kc"), py::arg("vc"), py::arg("cos"), py::arg("sin"),
           py::arg("pos"), py::arg("mask"), py::arg("b0"), py::arg("S"), py::arg("aux_ids"), py::arg("h0") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           "the layers over a block: (final normed h [B, T, H], aux residuals [B, T, n * H])");
}
