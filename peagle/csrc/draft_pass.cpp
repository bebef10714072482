// A drafter head's greedy pass over one row's block in one call (peagle/heads/model.py DrafterHead.greedy_pass):
// the ops its Python path runs one by one -- fc of the target's aux states, the mask rows appended (P-EAGLE), the
// embedding, layer 0's two input norms, the layers (forward.cpp's LayerStack), the LM head over the drafted rows,
// their argmax and the draft -> target vocabulary map -- with the same functions on the same rows in the same
// order (ops.h; argmax.cpp's argmax), so the same bits and the same drafts. After a step's weight stream each torch
// op between the C++ calls pays its cache misses (lab/measure/step_glue.py); here they are one call.
//
// Per pass (W = T + n_mask rows): x = fc(hidden[:T]) (fc false: hidden as given, EAGLE-3's later passes feeding the
// drafter's own prenorm output), then n_mask rows of mask_h; ids likewise with mask_token_id; hn = rms_norm(x, hid_norm),
// h0 = [rms_norm(embed[ids], emb_norm) || hn], the residual hn or x (norm_before_residual); the layers; drafts =
// argmax(normed[first:] @ lm^T) + d2t[.]. Returns (drafts [1, W - first] int64, prenorm [1, W, H]).
namespace {

// A product's weight (forward.cpp's Proj), checked as qlinear / qlinear_a8 check theirs.
Proj draft_linear(torch::Tensor w, torch::Tensor packed, int64_t qtype, int64_t N, int64_t K, bool act8) {
  check_weight(w, qtype, N, K, !act8);
  return make_proj(w, packed, (int)qtype, N, K, act8, "DraftHead");
}

// p's product of M rows at impl 0, with its own scratch for the 8-bit activations.
void run_proj(const Proj& p, const float* x, int64_t M, float* y) {
  std::vector<int8_t> xq(M * p.K);
  std::vector<float> xd(M * p.K / 32), xs(M * p.K / 32);
  p.run(x, M, y, 0, {xq.data(), xd.data(), xs.data()});
}

class DraftHead {
 public:
  DraftHead(torch::Tensor fc_w, torch::Tensor fc_packed, int64_t fc_qtype, int64_t fc_in, torch::Tensor lm_w,
            torch::Tensor lm_packed, int64_t lm_qtype, int64_t lm_out, bool act8, torch::Tensor embed, torch::Tensor emb_norm,
            torch::Tensor hid_norm, double eps, bool norm_before_residual, torch::Tensor mask_h,
            int64_t mask_token_id, torch::Tensor d2t)
      : eps_((float)eps), nbr_(norm_before_residual), mask_id_(mask_token_id) {
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && embed.dim() == 2 && embed.is_contiguous(),
                "DraftHead: embed [V, H] float32, contiguous");
    H_ = embed.size(1);
    fc_ = draft_linear(fc_w, fc_packed, fc_qtype, H_, fc_in, act8);
    lm_ = draft_linear(lm_w, lm_packed, lm_qtype, lm_out, H_, act8);
    for (auto* t : {&emb_norm, &hid_norm})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->numel() == H_, "DraftHead: norms of H floats");
    TORCH_CHECK(mask_h.numel() == 0 || (mask_h.scalar_type() == torch::kFloat32 && mask_h.numel() == H_),
                "DraftHead: mask_h [H] float32 (or empty)");
    TORCH_CHECK(d2t.numel() == 0 || (d2t.scalar_type() == torch::kLong && d2t.numel() == lm_out),
                "DraftHead: d2t [draft vocab] int64 (or empty)");
    embed_ = embed;
    emb_norm_ = emb_norm.contiguous();
    hid_norm_ = hid_norm.contiguous();
    mask_h_ = mask_h.contiguous();
    d2t_ = d2t.contiguous();
  }

  std::vector<torch::Tensor> pass(LayerStack& stack, torch::Tensor ids, torch::Tensor hidden, int64_t n_mask,
                                  std::vector<torch::Tensor> kc, std::vector<torch::Tensor> vc, torch::Tensor cos,
                                  torch::Tensor sin, torch::Tensor pos, c10::optional<torch::Tensor> mask, int64_t b0,
                                  int64_t S, int64_t first, bool fc) {
    const int64_t H = H_, V = embed_.size(0);
    TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 2 && ids.size(0) == 1, "pass: ids [1, T] int64");
    const int64_t T = ids.size(1), W = T + n_mask;
    TORCH_CHECK(T >= 1 && n_mask >= 0 && first >= 0 && first < W, "pass: T >= 1, n_mask >= 0, 0 <= first < W");
    TORCH_CHECK(n_mask == 0 || mask_h_.numel() == H, "pass: mask rows need the head's mask_h");
    auto hc = hidden.contiguous();
    TORCH_CHECK(hc.scalar_type() == torch::kFloat32 && hc.numel() == T * hc.size(-1) && hc.size(-1) == (fc ? fc_.K : H),
                "pass: hidden [1, T, fc inputs or H] float32");
    auto x = torch::empty({1, W, H}, hc.options()), h0 = torch::empty({1, W, 2 * H}, hc.options());
    float *px = x.data_ptr<float>(), *ph0 = h0.data_ptr<float>();
    if (fc) run_proj(fc_, hc.data_ptr<float>(), T, px);
    else std::copy(hc.data_ptr<float>(), hc.data_ptr<float>() + T * H, px);
    for (int64_t r = T; r < W; r++) std::copy(mask_h_.data_ptr<float>(), mask_h_.data_ptr<float>() + H, px + r * H);
    auto ic = ids.contiguous();
    const int64_t* pi = ic.data_ptr<int64_t>();
    std::vector<float> emb(W * H), normed(W * H);
    for (int64_t r = 0; r < W; r++) {
      const int64_t id = r < T ? pi[r] : mask_id_;
      TORCH_CHECK(id >= 0 && id < V, "pass: token id ", id, " outside the embedding's ", V);
      std::copy(embed_.data_ptr<float>() + id * H, embed_.data_ptr<float>() + (id + 1) * H, emb.data() + r * H);
    }
    po::rms_norm(px, hid_norm_.data_ptr<float>(), W, H, eps_, normed.data());   // hn
    std::vector<float> en(W * H);
    po::rms_norm(emb.data(), emb_norm_.data_ptr<float>(), W, H, eps_, en.data());
    for (int64_t r = 0; r < W; r++) {
      std::copy(en.data() + r * H, en.data() + (r + 1) * H, ph0 + r * 2 * H);
      std::copy(normed.data() + r * H, normed.data() + (r + 1) * H, ph0 + r * 2 * H + H);
    }
    torch::Tensor resid = x;
    if (nbr_) {
      resid = torch::empty({1, W, H}, hc.options());
      std::copy(normed.begin(), normed.end(), resid.data_ptr<float>());
    }
    const int64_t n = stack.layers();
    auto out = stack.forward(resid, kc, vc, cos, sin, pos, mask, b0, S, {n}, h0);   // (normed h, prenorm)
    const int64_t J = W - first, Vd = lm_.N;
    std::vector<float> logits(J * Vd);
    run_proj(lm_, out[0].data_ptr<float>() + first * H, J, logits.data());
    auto drafts = torch::empty({1, J}, ids.options());
    int64_t* pd = drafts.data_ptr<int64_t>();
    const bool avx512 = po::use_avx512(0), avx2 = po::use_avx2(0);
    for (int64_t j = 0; j < J; j++) {
      const int64_t a = argmax_row(logits.data() + j * Vd, Vd, avx512, avx2);
      pd[j] = d2t_.numel() ? a + d2t_.data_ptr<int64_t>()[a] : a;
    }
    return {drafts, out[1]};
  }

 private:
  Proj fc_, lm_;
  torch::Tensor embed_, emb_norm_, hid_norm_, mask_h_, d2t_;
  int64_t H_ = 0;
  float eps_;
  bool nbr_;
  int64_t mask_id_;
};

}  // namespace

void bind_draft_pass(py::module& m) {
  py::class_<DraftHead>(m, "DraftHead")
      .def(py::init<torch::Tensor, torch::Tensor, int64_t, int64_t, torch::Tensor, torch::Tensor, int64_t, int64_t, bool,
                    torch::Tensor, torch::Tensor, torch::Tensor, double, bool, torch::Tensor, int64_t,
                    torch::Tensor>())
      .def("pass_", &DraftHead::pass, py::arg("stack"), py::arg("ids"), py::arg("hidden"), py::arg("n_mask"),
           py::arg("kc"), py::arg("vc"), py::arg("cos"), py::arg("sin"), py::arg("pos"), py::arg("mask"), py::arg("b0"),
           py::arg("S"), py::arg("first"), py::arg("fc"), py::call_guard<py::gil_scoped_release>(),
           "one greedy drafter pass over a row's block: (drafts [1, W - first] in the target vocabulary, prenorm)");
}
