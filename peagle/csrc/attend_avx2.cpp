// attend_impl.h compiled for AVX2 + FMA (chosen at run time when the CPU has them).
#pragma GCC target("avx2,fma,f16c")
#define PEAGLE_ATTEND_AVX2
#define PEAGLE_ATTEND_NS avx2
#include "attend_impl.h"
