// attend_impl.h for any CPU (the same operations as the AVX2 build, bit for bit).
#include "attend_impl.h"

namespace peagle_attend {
namespace generic {
void attend(const AttnArgs& a, int64_t idx0, int64_t idx1) { attend_range(a, idx0, idx1); }
}  // namespace generic
}  // namespace peagle_attend
