// attend_impl.h compiled for AVX-512 (chosen at run time with the AVX-512 products): two queries per zmm in the
// dot products, 16 lanes in e^x and the value sums; the AVX2 build's bits.
#include <algorithm>   // the standard headers before the target pragma: none of their code is built for AVX-512
#include <cmath>
#include <cstring>
#include <vector>

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define PEAGLE_ATTEND_AVX2
#define PEAGLE_ATTEND_AVX512
#define PEAGLE_ATTEND_NS avx512
#include "attend_impl.h"
