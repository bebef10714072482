// attend_impl.h compiled for AVX2 + FMA (chosen at run time when the CPU has them).
#pragma GCC target("avx2,fma")
#define PEAGLE_ATTEND_AVX2
#include "attend_impl.h"

namespace peagle_attend {
namespace avx2 {
void attend(const AttnArgs& a, int64_t idx0, int64_t idx1) { attend_range(a, idx0, idx1); }
}  // namespace avx2
}  // namespace peagle_attend
