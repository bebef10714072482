// Greedy token choice: each row's argmax exactly as torch's max(-1).indices gives it -- the first index of the
// maximum; a NaN counts as the maximum (its first occurrence wins); all -inf gives 0 -- in one pass over the
// row. The indices are integers, so every path (scalar, AVX2, AVX-512) returns the same ones; they differ in
// speed only: torch's reduction keeps an index beside each value lane by lane and ran ~25 us per 49152-logit
// row on a 2-core Intel Xeon, where one vector pass reads the row in a few.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <climits>
#include <cmath>

#include "ops.h"

namespace po = peagle_ops;

namespace {

// The first NaN among x[0..V) (the caller has seen one).
int64_t first_nan(const float* x, int64_t V) {
  int64_t i = 0;
  while (i < V - 1 && !std::isnan(x[i])) i++;
  return i;
}

// Elements [i0, V) after a running best (value bv at index best): a strictly larger value replaces it, a NaN
// ends the search with its index.
int64_t scan_tail(const float* x, int64_t i0, int64_t V, float bv, int64_t best) {
  for (int64_t i = i0; i < V; i++) {
    const float v = x[i];
    if (std::isnan(v)) return i;
    if (v > bv) bv = v, best = i;
  }
  return best;
}

int64_t argmax_scalar(const float* x, int64_t V) {
  return std::isnan(x[0]) ? 0 : scan_tail(x, 1, V, x[0], 0);
}

// Four accumulators of 16 lanes: lane l of accumulator a keeps the largest value among elements 64 j + 16 a + l
// and the first index where it occurred (strictly greater replaces). The first index of the row's maximum is
// then the smallest kept index among the lanes holding that maximum; a NaN anywhere sends the row to first_nan.
__attribute__((target("avx512f,avx512dq"))) int64_t argmax_avx512(const float* x, int64_t V) {
  if (V < 64) return argmax_scalar(x, V);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(64);
  __m512 bv[4];
  __m512i bi[4], idx[4];
  __mmask16 nan = 0;
  for (int a = 0; a < 4; a++) {
    idx[a] = bi[a] = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * a));
    bv[a] = _mm512_loadu_ps(x + 16 * a);
    nan |= _mm512_cmp_ps_mask(bv[a], bv[a], _CMP_UNORD_Q);
  }
  int64_t i = 64;
  for (; i + 64 <= V; i += 64) {
    #pragma GCC unroll 4
    for (int a = 0; a < 4; a++) {
      idx[a] = _mm512_add_epi32(idx[a], step);
      const __m512 v = _mm512_loadu_ps(x + i + 16 * a);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv[a], _CMP_GT_OQ);
      bv[a] = _mm512_mask_mov_ps(bv[a], gt, v);
      bi[a] = _mm512_mask_mov_epi32(bi[a], gt, idx[a]);
    }
  }
  if (nan) return first_nan(x, i);
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(bv[0], bv[1]), _mm512_max_ps(bv[2], bv[3])));
  const __m512 mxv = _mm512_set1_ps(mx);
  int32_t best = INT_MAX;
  for (int a = 0; a < 4; a++) {
    const int32_t b = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv[a], mxv, _CMP_EQ_OQ), bi[a]);
    best = b < best ? b : best;
  }
  return scan_tail(x, i, V, mx, best);   // later indices: only a strictly larger value (or a NaN) replaces
}

// The same with four accumulators of 8 lanes.
__attribute__((target("avx2,fma"))) int64_t argmax_avx2(const float* x, int64_t V) {
  if (V < 32) return argmax_scalar(x, V);
  const __m256i step = _mm256_set1_epi32(32);
  __m256 bv[4], nan = _mm256_setzero_ps();
  __m256i bi[4], idx[4];
  for (int a = 0; a < 4; a++) {
    idx[a] = bi[a] = _mm256_setr_epi32(8 * a, 8 * a + 1, 8 * a + 2, 8 * a + 3, 8 * a + 4, 8 * a + 5, 8 * a + 6,
                                       8 * a + 7);
    bv[a] = _mm256_loadu_ps(x + 8 * a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(bv[a], bv[a], _CMP_UNORD_Q));
  }
  int64_t i = 32;
  for (; i + 32 <= V; i += 32) {
    #pragma GCC unroll 4
    for (int a = 0; a < 4; a++) {
      idx[a] = _mm256_add_epi32(idx[a], step);
      const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, bv[a], _CMP_GT_OQ);
      bv[a] = _mm256_blendv_ps(bv[a], v, gt);
      bi[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi[a]), _mm256_castsi256_ps(idx[a]), gt));
    }
  }
  if (_mm256_movemask_ps(nan)) return first_nan(x, i);
  alignas(32) float vals[32];
  alignas(32) int32_t ids[32];
  for (int a = 0; a < 4; a++) {
    _mm256_store_ps(vals + 8 * a, bv[a]);
    _mm256_store_si256((__m256i*)(ids + 8 * a), bi[a]);
  }
  float mx = vals[0];
  for (int l = 1; l < 32; l++) mx = vals[l] > mx ? vals[l] : mx;
  int32_t best = INT_MAX;
  for (int l = 0; l < 32; l++)
    if (vals[l] == mx && ids[l] < best) best = ids[l];
  return scan_tail(x, i, V, mx, best);
}

// One row's argmax on the widest path allowed (use_avx512 / use_avx2 of the call's impl): the same index on each.
int64_t argmax_row(const float* row, int64_t V, bool avx512, bool avx2) {
  return avx512 ? argmax_avx512(row, V) : avx2 ? argmax_avx2(row, V) : argmax_scalar(row, V);
}

// x [..., V] float32 -> int64 [...]: impl 0 = best for this CPU, 1 = scalar, 2 = AVX2, 3 = AVX-512 (ops.h's).
torch::Tensor argmax_last(torch::Tensor x, int64_t impl) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() >= 1 && x.size(-1) > 0,
              "argmax_last: a float32 CPU tensor with a non-empty last dimension");
  const int64_t V = x.size(-1);
  TORCH_CHECK(V < INT_MAX - 64, "argmax_last: rows of at most 2^31 - 64 elements");
  const bool avx512 = po::use_avx512(impl), avx2 = po::use_avx2(impl);   // impl 4: AVX-512's
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, xc.options().dtype(torch::kLong));
  const float* px = xc.data_ptr<float>();
  int64_t* po_ = out.data_ptr<int64_t>();
  const int64_t R = xc.numel() / V;
  // a row is a few microseconds: rows go to threads from 4 up (a fork costs ~1 us)
  at::parallel_for(0, R, 3, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* row = px + r * V;
      po_[r] = argmax_row(row, V, avx512, avx2);
    }
  });
  return out;
}

// Greedy verification and the rows' advance in one call (peagle/verify.py verify_greedy_advance): per row b,
// target = the argmax of each of its K+1 positions, accepted = the length of the prefix where drafts[b] agrees
// with it; last[b] = target[b, accepted], lens[b] += accepted + 1 (in place). Returns [B, K+2]: accepted, then
// the K+1 targets. A decode step's few torch ops here were one call: after a step's weight stream has evicted
// the caches, each torch op pays its misses (lab/measure/step_glue.py).
torch::Tensor verify_greedy_advance(torch::Tensor logits, torch::Tensor drafts, torch::Tensor last, torch::Tensor lens,
                                    int64_t impl) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 3 &&
                  logits.size(2) > 0, "verify_greedy_advance: logits [B, K+1, V] float32 on the CPU");
  const int64_t B = logits.size(0), K1 = logits.size(1), V = logits.size(2);
  TORCH_CHECK(V < INT_MAX - 64 && K1 >= 1, "verify_greedy_advance: rows of at most 2^31 - 64 logits, K+1 >= 1");
  TORCH_CHECK(drafts.scalar_type() == torch::kLong && drafts.dim() == 2 && drafts.size(0) == B &&
                  drafts.size(1) == K1 - 1, "verify_greedy_advance: drafts [B, K] int64");
  for (const auto& t : {last, lens})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kLong && t.dim() == 1 && t.is_contiguous() &&
                    t.size(0) >= B, "verify_greedy_advance: last and lens [rows >= B] contiguous int64");
  const bool avx512 = po::use_avx512(impl), avx2 = po::use_avx2(impl);
  auto xc = logits.contiguous();
  auto dc = drafts.contiguous();
  auto out = torch::empty({B, K1 + 1}, xc.options().dtype(torch::kLong));
  const float* px = xc.data_ptr<float>();
  const int64_t* pd = dc.data_ptr<int64_t>();
  int64_t *po_ = out.data_ptr<int64_t>(), *pl = last.data_ptr<int64_t>(), *pn = lens.data_ptr<int64_t>();
  at::parallel_for(0, B * K1, 3, [&](int64_t r0, int64_t r1) {   // argmax_last's split
    for (int64_t r = r0; r < r1; r++) {
      const float* row = px + r * V;
      po_[r / K1 * (K1 + 1) + 1 + r % K1] = argmax_row(row, V, avx512, avx2);
    }
  });
  for (int64_t b = 0; b < B; b++) {
    int64_t* o = po_ + b * (K1 + 1);
    int64_t a = 0;
    while (a < K1 - 1 && pd[b * (K1 - 1) + a] == o[1 + a]) a++;
    o[0] = a;
    pl[b] = o[1 + a];
    pn[b] += a + 1;
  }
  return out;
}

}  // namespace

void bind_argmax(py::module& m) {
  m.def("argmax_last", &argmax_last, "each row's argmax as torch's max(-1).indices (first maximum; NaN wins)",
        py::arg("x"), py::arg("impl") = 0);
  m.def("verify_greedy_advance", &verify_greedy_advance,
        "greedy verification of [B, K+1, V] logits against drafts [B, K], advancing last / lens in place; "
        "-> [B, K+2] (accepted, targets)", py::arg("logits"), py::arg("drafts"), py::arg("last"), py::arg("lens"),
        py::arg("impl") = 0);
}
