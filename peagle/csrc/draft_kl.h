// The drafter's training loss in one pass per element (peagle/train/head_forward.py DraftKL): per row e of the
// draft logits z [E, V] (float32, or bfloat16 as raw 16-bit words) against the target's log-probabilities over
// the draft vocabulary, row rows[e] of t [n, V] (float32),
//   m = max_v z_v (top = the first v reaching it),  lse = m + log sum_v e^(z_v - m),
//   kl = sum_v e^(t_v) (t_v - z_v) + lse,  and backward  grad_v = (e^(z_v - lse) - e^(t_v)) * g.
// No torch headers: draft_kl_avx2.cpp / draft_kl_avx512.cpp are compiled for their ISA; draft_kl.cpp binds, picks
// the path from the CPU's flags and splits the elements over threads.
#pragma once
#include <cstdint>

namespace peagle_kl {

struct KLArgs {
  const void* z;         // [E, V] rows zs elements apart, float32 or bfloat16 (bf16 = true)
  bool bf16;
  int64_t zs;
  const float* t;        // [n, V] rows ts apart
  int64_t ts;
  const int64_t* rows;   // [E]: each element's row of t
  int64_t V;             // a multiple of 8
};

// Elements e0..e1-1: kl[e], lse[e], top[e].
void forward_avx2(const KLArgs& a, int64_t e0, int64_t e1, float* kl, float* lse, int64_t* top);
// Elements e0..e1-1: grad [E, V] contiguous, z's dtype (bfloat16 rounded to nearest even), from lse and g [E].
void backward_avx2(const KLArgs& a, int64_t e0, int64_t e1, const float* lse, const float* g, void* grad);
// The same on 16 lanes (draft_kl_avx512.cpp; AVX-512 F/BW/VL/DQ).
void forward_avx512(const KLArgs& a, int64_t e0, int64_t e1, float* kl, float* lse, int64_t* top);
void backward_avx512(const KLArgs& a, int64_t e0, int64_t e1, const float* lse, const float* g, void* grad);

}  // namespace peagle_kl
