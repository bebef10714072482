// attend_impl.h compiled for AVX-512 (chosen at run time with the AVX-512 products): two queries per zmm in the
// dot products, 16 lanes in e^x and the value sums; the AVX2 build's bits.
#include <algorithm>   // the standard headers before the target pragma: none of their code is built for AVX-512
#include <cmath>
#include <cstring>
#include <vector>

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define PEAGLE_ATTEND_AVX2
#define PEAGLE_ATTEND_AVX512
#include "attend_impl.h"

namespace peagle_attend {
namespace avx512 {
// Tasks: attend_blocked's (hd 64 or 128), else queries as attend_range's (on AVX2 lanes).
int64_t tasks(const AttnArgs& a) { return a.hd == 64 || a.hd == 128 ? blocked_tasks(a) : a.B * a.T * a.nh; }
void attend(const AttnArgs& a, int64_t t0, int64_t t1) {
  if (a.hd == 64) return attend_blocked<64>(a, t0, t1);
  if (a.hd == 128) return attend_blocked<128>(a, t0, t1);
  attend_range(a, t0, t1);
}
}  // namespace avx512
}  // namespace peagle_attend
