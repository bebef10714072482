// AMX path of the training attention's score products (train_attn.h): out = a b^T for bfloat16 a [M, D], b [N, D]
// (D a multiple of 32), in float32. b is first packed into the tile unit's pair layout ([Np/16][D/2][16][2], Np =
// N rounded up to 32 with zero keys: for each 16 keys, each pair of head dims, the 16 keys' two values), so each
// 16 keys x 32 head dims are one B tile; a's rows load as A tiles straight from memory. Per 32 rows x 32 keys,
// four C tiles [16 x 16] float32 sum TDPBF16PS over D / 32 steps. Each product of two bfloat16 values is exact in
// float32; the sums run in float32 (the tile unit flushes denormals). Rows or keys past the ends go through
// zeroed scratch tiles. Chosen where the CPU has AMX-BF16 and the OS grants the tile state (ops.h); torch's float32
// products elsewhere. The same tiles multiply a strip of 32 rows of P (or dS), zero-padded to Kp keys, by the
// values (or keys) packed in pairs along the keys: the attention's P V and dS K. No torch headers.
#include <algorithm>   // the standard headers before the target pragma: none of their code is built for AMX
#include <cstdint>
#include <cstring>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,amx-tile,amx-bf16")
#include <immintrin.h>

#include "amx_inline.h"
#include "train_attn.h"

namespace peagle_tattn {

namespace {

// Tiles 0-3: C [16 x 16] float32; 4, 5: A (two blocks of 16 rows, 32 head dims); 6, 7: B (two blocks of 16 keys).
void configure() { peagle_amx::configure_tiles(8); }

// Scratch s [16 x 16] float32 -> out (row stride ldo floats): rows < nr, keys < nc.
inline void copy_part(const float* s, float* out, int64_t ldo, int64_t nr, int64_t nc) {
  for (int64_t r = 0; r < std::min<int64_t>(nr, 16); r++)
    std::memcpy(out + r * ldo, s + 16 * r, 4 * std::max<int64_t>(0, std::min<int64_t>(nc, 16)));
}

// C tile T to out: whole tiles directly, a part through scratch (the tile macros take the tile's number as text).
#define STORE_C(T, out, ldo, nr, nc)                   \
  do {                                                 \
    if ((nr) >= 16 && (nc) >= 16) {                    \
      _tile_stored(T, out, (ldo) * 4);                 \
    } else if ((nr) > 0 && (nc) > 0) {                 \
      _tile_stored(T, scratch, 64);                    \
      copy_part(scratch, out, ldo, nr, nc);            \
    }                                                  \
  } while (0)

}  // namespace

void pack_pairs(const uint16_t* const* b, int64_t N, int64_t D, uint16_t* out) {
  const int64_t Np = round32(N);
  for (int64_t j0 = 0; j0 < Np; j0 += 16) {
    uint32_t* o = (uint32_t*)(out + j0 * D);              // [D/2][16] pairs for keys j0..j0+15
    for (int64_t l = 0; l < 16; l++) {
      const int64_t j = j0 + l;
      for (int64_t p = 0; p < D / 2; p++) {
        uint32_t w = 0;
        if (j < N) std::memcpy(&w, b[j] + 2 * p, 4);
        o[16 * p + l] = w;
      }
    }
  }
}

void scores_amx(const uint16_t* a, int64_t lda, const uint16_t* bp, int64_t N, int64_t D, int64_t m0, int64_t m1,
                float* out, int64_t ldo) {
  configure();
  alignas(64) uint16_t pad[2][16 * 32];                   // A rows past m1 (32 dims per step), zero
  alignas(64) float scratch[16 * 16];
  for (int64_t m = m0; m < m1; m += 32) {
    const int64_t nr = m1 - m;                            // rows left: > 0
    for (int64_t j = 0; j < N; j += 32) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t h = 0; h < D; h += 32) {
        for (int blk = 0; blk < 2; blk++) {
          const int64_t r = m + 16 * blk, have = std::min<int64_t>(16, std::max<int64_t>(0, m1 - r));
          if (have == 16) {
            if (blk) _tile_loadd(5, a + r * lda + h, lda * 2);
            else _tile_loadd(4, a + r * lda + h, lda * 2);
          } else {
            std::memset(pad[blk], 0, sizeof(pad[blk]));
            for (int64_t i = 0; i < have; i++) std::memcpy(pad[blk] + 32 * i, a + (r + i) * lda + h, 64);
            if (blk) _tile_loadd(5, pad[blk], 64);
            else _tile_loadd(4, pad[blk], 64);
          }
        }
        _tile_loadd(6, bp + j * D + 16 * h, 64);          // keys j..j+15, dims h..h+31
        _tile_loadd(7, bp + (j + 16) * D + 16 * h, 64);   // keys j+16..j+31
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* o = out + m * ldo + j;
      const int64_t nc = N - j;
      STORE_C(0, o, ldo, nr, nc);
      STORE_C(1, o + 16, ldo, nr, nc - 16);
      STORE_C(2, o + 16 * ldo, ldo, nr - 16, nc);
      STORE_C(3, o + 16 * ldo + 16, ldo, nr - 16, nc - 16);
    }
  }
  _tile_release();
}

void pack_pairs_k(const uint16_t* const* b, int64_t K, int64_t N, uint16_t* out) {
  const int64_t Kp = round32(K);
  for (int64_t c = 0; c < N / 16; c++) {
    uint32_t* o = (uint32_t*)(out + c * Kp * 16);         // [Kp/2][16] pairs for columns 16c..16c+15
    for (int64_t p = 0; p < Kp / 2; p++)
      for (int64_t l = 0; l < 16; l++) {
        const uint16_t lo = 2 * p < K ? b[2 * p][16 * c + l] : 0;
        const uint16_t hi = 2 * p + 1 < K ? b[2 * p + 1][16 * c + l] : 0;
        o[16 * p + l] = (uint32_t)lo | ((uint32_t)hi << 16);
      }
  }
}

void strip_times_amx(const uint16_t* a, int64_t Kp, int64_t nr, const uint16_t* bp, int64_t N, float* out,
                     int64_t ldo) {
  configure();
  alignas(64) float scratch[16 * 16];
  for (int64_t h = 0; h < N; h += 32) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint16_t* b0 = bp + h * Kp;                       // columns h..h+15, then h+16..h+31
    const uint16_t* b1 = b0 + 16 * Kp;
    for (int64_t k = 0; k < Kp; k += 32) {
      _tile_loadd(4, a + k, Kp * 2);
      _tile_loadd(5, a + 16 * Kp + k, Kp * 2);
      _tile_loadd(6, b0 + 16 * k, 64);
      _tile_loadd(7, b1 + 16 * k, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* o = out + h;
    STORE_C(0, o, ldo, nr, 16);
    STORE_C(1, o + 16, ldo, nr, 16);
    STORE_C(2, o + 16 * ldo, ldo, nr - 16, 16);
    STORE_C(3, o + 16 * ldo + 16, ldo, nr - 16, 16);
  }
  _tile_release();
}

}  // namespace peagle_tattn
