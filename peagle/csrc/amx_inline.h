// The tile unit's configuration shared by the AMX kernels (quant_amx.cpp, train_scores_amx.cpp): palette 1, the
// first n tiles [16 rows x 64 bytes]. Included only by translation units compiled for AMX-TILE.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace peagle_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static inline void configure_tiles(int n) {
  TileConfig c;
  for (int t = 0; t < n; t++) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

}  // namespace peagle_amx
