// Portable path: the AVX2 path's arithmetic, one lane at a time (std::fma where it fuses).
#include <cfloat>
#include <cmath>
#include <cstring>

#include "quant_kernels.h"

namespace peagle_quant {
namespace scalar {

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {                                   // subnormal: normalise
      int e = -1;
      do { e++; man <<= 1; } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void dequant_row(int qtype, const uint8_t* row, int64_t K, float* dst) {
  const int bs = block_bytes(qtype);
  for (int64_t b = 0; b < K / 32; b++, row += bs, dst += 32) {
    if (qtype == Q4_0) {
      const float d = half_to_float(row);
      for (int j = 0; j < 16; j++) {
        dst[j] = d * (float)((int)(row[2 + j] & 15) - 8);
        dst[j + 16] = d * (float)((int)(row[2 + j] >> 4) - 8);
      }
    } else if (qtype == Q4_1) {
      const float d = half_to_float(row), m = half_to_float(row + 2);
      for (int j = 0; j < 16; j++) {
        dst[j] = std::fma(d, (float)(row[4 + j] & 15), m);
        dst[j + 16] = std::fma(d, (float)(row[4 + j] >> 4), m);
      }
    } else {
      const float d = half_to_float(row);
      for (int j = 0; j < 32; j++) dst[j] = d * (float)(int8_t)row[2 + j];
    }
  }
}

static inline float dot(const float* w, const float* x, int64_t K) {
  float a[8] = {0}, v4[4];
  for (int64_t k = 0; k < K; k += 8)
    for (int l = 0; l < 8; l++) a[l] = std::fma(w[k + l], x[k + l], a[l]);
  for (int l = 0; l < 4; l++) v4[l] = a[l] + a[l + 4];
  const float v20 = v4[0] + v4[2], v21 = v4[1] + v4[3];
  return v20 + v21;
}

// Output n's weights of an F32 tensor packed by 8 (quant_kernels.h), gathered into dst [K].
static void f32_row(const float* w, int64_t n, int64_t K, float* dst) {
  const float* g = w + (n / 8) * 8 * K + 8 * (n % 8);
  for (int64_t c = 0; c < K / 8; c++) std::memcpy(dst + 8 * c, g + 64 * c, 8 * sizeof(float));
}

void linear_rows(int qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* buf) {
  for (int64_t n = n0; n < n1; n++) {
    if (qtype == F32)
      f32_row((const float*)w, n, K, buf);
    else
      dequant_row(qtype, w + n * row_bytes, K, buf);
    for (int64_t r = 0; r < M; r++) y[r * N + n] = dot(buf, x + r * K, K);
  }
}

// 8-bit activations (quant_kernels.h): one output and row at a time, the AVX2 path's operations and order.
void linear_rows_a8(int qtype, const uint8_t* w, int64_t row_bytes, const int8_t* xq, const float* xd,
                    const float* xs, int64_t M, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  const int bs = block_bytes(qtype);
  int32_t wq[32];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t r = 0; r < M; r++) {
      float acc = 0.0f, s = 0.0f;
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = row + b * bs;
        const float d = half_to_float(blk);
        if (qtype == Q8_0) {
          for (int j = 0; j < 32; j++) wq[j] = (int8_t)blk[2 + j];
        } else {
          const int off = qtype == Q4_1 ? 4 : 2;
          for (int j = 0; j < 16; j++) {
            wq[j] = blk[off + j] & 15;
            wq[j + 16] = blk[off + j] >> 4;
          }
        }
        const int8_t* xb = xq + r * K + b * 32;
        int32_t p = 0;
        for (int j = 0; j < 32; j++) p += wq[j] * (int32_t)xb[j];
        acc = std::fma(d * xd[r * nb + b], (float)p, acc);
      }
      if (qtype != Q8_0)
        for (int64_t b = 0; b < nb; b++) {
          const uint8_t* blk = row + b * bs;
          const float m = qtype == Q4_1 ? half_to_float(blk + 2) : half_to_float(blk) * -8.0f;
          s = std::fma(m, xs[r * nb + b], s);
        }
      y[r * N + n] = qtype == Q8_0 ? acc : acc + s;
    }
  }
}

}  // namespace scalar

void pack_a8(int qtype, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32, G = (N + 7) / 8;
  const int bs = block_bytes(qtype), gb = a8_group_block_bytes(qtype), dsz = qtype == Q4_1 ? 32 : 16;
  const int off = qtype == Q4_1 ? 4 : 2, rows = qtype == Q8_0 ? 8 : 4;
  std::memset(out, 0, (size_t)(G * nb * gb));
  for (int64_t g = 0; g < G; g++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t* o = out + (g * nb + b) * gb;
      for (int j = 0; j < 8 && 8 * g + j < N; j++) {
        const uint8_t* blk = w + (8 * g + j) * nb * bs + b * bs;
        std::memcpy(o + 2 * j, blk, 2);                               // d
        if (qtype == Q4_1) std::memcpy(o + 16 + 2 * j, blk + 2, 2);   // m
        for (int c = 0; c < rows; c++) std::memcpy(o + dsz + 32 * c + 4 * j, blk + off + 4 * c, 4);
      }
    }
}

void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < M; r++)
    for (int64_t b = 0; b < nb; b++) {
      const float* v = x + r * K + b * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; i++) amax = std::fmax(amax, std::fabs(v[i]));
      const float d = amax / 127.0f, id = d >= FLT_MIN ? 1.0f / d : 0.0f;   // 1/d finite; a smaller d: all zeros
      int32_t sum = 0;
      int8_t* q = xq + r * K + b * 32;
      for (int i = 0; i < 32; i++) {
        const float t = std::nearbyint(v[i] * id);
        q[i] = (int8_t)std::fmax(-127.0f, std::fmin(127.0f, t));
        sum += q[i];
      }
      xd[r * nb + b] = d;
      xs[r * nb + b] = d * (float)sum;
    }
}
}  // namespace peagle_quant
