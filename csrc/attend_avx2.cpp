// attend_impl.h compiled for AVX2 + FMA (chosen at run time when the CPU has them).
#pragma GCC target("avx2,fma,f16c")
#define PEAGLE_ATTEND_AVX2
#include "attend_impl.h"

namespace peagle_attend {
namespace avx2 {
// Tasks: attend_blocked's (hd 64 or 128), else queries as attend_range's.
int64_t tasks(const AttnArgs& a) { return a.hd == 64 || a.hd == 128 ? blocked_tasks(a) : a.B * a.T * a.nh; }
void attend(const AttnArgs& a, int64_t t0, int64_t t1) {
  if (a.hd == 64) return attend_blocked<64>(a, t0, t1);
  if (a.hd == 128) return attend_blocked<128>(a, t0, t1);
  attend_range(a, t0, t1);
}
}  // namespace avx2
}  // namespace peagle_attend
