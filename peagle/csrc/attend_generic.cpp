// attend_impl.h for any CPU (the same operations as the AVX2 build, bit for bit).
#include "attend_impl.h"

namespace peagle_attend {
namespace generic {
int64_t tasks(const AttnArgs& a) { return a.B * a.T * a.nh; }
void attend(const AttnArgs& a, int64_t idx0, int64_t idx1) { attend_range(a, idx0, idx1); }
}  // namespace generic
}  // namespace peagle_attend
