// AMX path of the 8-bit-activation products (chosen at run time where the CPU has AMX-TILE + AMX-INT8, the OS
// grants the tile state and a probe product comes out right; impl 4). Only each block's integer dot products
// move to the tile unit: per pair of groups (16 outputs) and block of 32, TDPBSUD (Q4: signed activations x
// unsigned nibbles) or TDPBSSD (Q8_0: signed x signed) sums p_b for 8 rows at once, exactly (int32, the same
// integer the AVX2 path's maddubs + madd and AVX-512's dpbusd produce), and the float part that follows is
// pair_a8's (quant_avx512_inline.h, shared with it): the same bits as every other path.
//
// Tiles (all [16 x 64] bytes): B = the pair's weights of two blocks in the tile unit's layout (row k4 holds bytes
// 4k4..4k4+3 of each of the 16 outputs; rows 8-15 the second block), unpacked from pack_a8's layout once per
// pair of groups into a scratch buffer and reused by every tile of rows; A = 8 rows' activations of the same two
// blocks laid out block-diagonally (pair_rows), so C's rows 0-7 / 8-15 are the two blocks' dots, lanes in
// pair_a8's order (group g's 8 outputs, then group g+1's). Measured on a 2-core Intel Xeon (KVM): one block per
// product (8 x 32 bytes of A) ran 1.03-1.06x AVX-512 at 8 rows, the block-diagonal pairs 1.2x. Not the tile
// arithmetic bounds it: on a later Xeon (family 6 model 167) the tile work, its C store above all, did not
// overlap the vector work around it (lab/measure/amx_overlap.py), so the unpacking, the tiles and the float part
// add up (ops.h: AMX_MIN_ROWS). No torch headers.
#include <algorithm>   // the standard headers before the target pragma: none of their code is built for AMX
#include <csetjmp>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <vector>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
#include <immintrin.h>

#include "amx_inline.h"
#include "quant_avx512_inline.h"
#include "quant_kernels.h"

namespace peagle_quant {
namespace amx {

namespace {

// C tiles 0, 1: [16 x 16] int32; A tiles 2, 3 and B tiles 4, 5: [16 x 64] bytes (one pair of blocks each, see
// groups_t).
void configure() { peagle_amx::configure_tiles(6); }

// Block b of the pair (groups at g and g + gs) -> the B tile [8 x 64] at out.
template <int QT>
inline void unpack_block(const uint8_t* q0, int64_t gs, uint8_t* out) {
  if constexpr (QT == Q8_0) {
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++)
      _mm512_store_si512((__m512i*)(out + 64 * c),
                         _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(q0 + 32 * c))),
                                            _mm256_loadu_si256((const __m256i*)(q0 + gs + 32 * c)), 1));
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(q0 + 32 * c))),
                                           _mm256_loadu_si256((const __m256i*)(q0 + gs + 32 * c)), 1);
      _mm512_store_si512((__m512i*)(out + 64 * c), _mm512_and_si512(w, m4));                          // weights 4c..
      _mm512_store_si512((__m512i*)(out + 64 * (4 + c)), _mm512_and_si512(_mm512_srli_epi16(w, 4), m4));  // 16+4c..
    }
  }
}

// One pair of groups (g: its first block, gs: the second group's distance; wt: its B tiles, 1024 bytes per pair of
// blocks) against TR rows (at: their A tiles, 1024 bytes per pair of blocks). A pair of blocks is one product:
// A's rows 0-7 hold the rows' bytes of the first block then 32 zeros, rows 8-15 32 zeros then the second
// block's, B's rows 0-7 the first block's weights, rows 8-15 the second's, so C's rows 0-7 are the first block's
// dots and rows 8-15 the second's (the zeros add nothing): one tile op per two blocks, four blocks in flight.
// The float part runs one step behind the tile products (double-buffered dots): a tile store is read back by
// vector loads only after it has long retired.
constexpr int TR = 8;
// Measured on a 2-core Intel Xeon (KVM), a SmolLM2 q4a8 forward of T rows, padded tile / AVX-512 rest: T = 17
// 12.5-12.9 / 11.4-11.5 ms, 18 12.7-13.0 / 12.0-12.1, 19 13.0-13.4 / 12.7-12.9, 20 13.1-13.5 / 13.2-13.3, 21
// 13.6-13.9 / 13.9-14.1, 33 21.3-22.0 / 20.5-20.8.
constexpr int64_t REST_VEC = 3;

template <int QT>
void pair_rows(const uint8_t* g, int64_t gs, const uint8_t* wt, const uint8_t* at, const float* xd, const float* xs,
               int64_t K, float* y, int64_t N, int valid, int rows_out, bool pf) {
  constexpr int gb = a8_group_block_bytes(QT);
  const int64_t nb = K / 32, nbp = (nb + 1) / 2, steps = (nbp + 1) / 2;
  alignas(64) int32_t dots[2][2][256];
  __m512 acc[TR], s[TR];
  #pragma GCC unroll 8
  for (int r = 0; r < TR; r++) acc[r] = s[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i <= steps; i++) {
    if (i < steps) {
      const int64_t j = 2 * i;
      _tile_zero(0);
      _tile_loadd(2, at + 1024 * j, 64);
      _tile_loadd(4, wt + 1024 * j, 64);
      if constexpr (QT == Q8_0) _tile_dpbssd(0, 2, 4);
      else _tile_dpbsud(0, 2, 4);
      if (j + 1 < nbp) {
        _tile_zero(1);
        _tile_loadd(3, at + 1024 * (j + 1), 64);
        _tile_loadd(5, wt + 1024 * (j + 1), 64);
        if constexpr (QT == Q8_0) _tile_dpbssd(1, 3, 5);
        else _tile_dpbsud(1, 3, 5);
      }
      _tile_stored(0, dots[i & 1][0], 64);
      if (j + 1 < nbp) _tile_stored(1, dots[i & 1][1], 64);
    }
    if (i > 0) {
      const int64_t b0 = 4 * (i - 1), b1 = std::min<int64_t>(b0 + 4, nb);
      for (int64_t b = b0; b < b1; b++) {
        if (pf) prefetch_ahead(g + b * gb, gs, gb, 2);   // the next pair's block, while the tiles work
        const int32_t* c = dots[(i - 1) & 1][(b - b0) / 2] + 128 * (b % 2);   // C's rows 0-7 or 8-15
        __m512i d[TR];
        #pragma GCC unroll 8
        for (int r = 0; r < TR; r++) d[r] = _mm512_load_si512((const __m512i*)(c + 16 * r));
        avx512::a8_block<QT, TR>(g + b * gb, gs, d, xd, xs, nb, b, acc, s);
      }
    }
  }
  avx512::a8_store<QT>(acc, s, rows_out, y, N, valid);
}

// Rows in tiles of 8 (the float accumulators of 8 rows stay in registers); a last tile of fewer rows runs as 8
// with zero rows after its own (zero activations and scales: their results are dropped), so the tiles keep one
// configuration (loading another costs more than the padding's products, measured), unless it has at most
// REST_VEC rows after full tiles: then it runs on the AVX-512 path (see REST_VEC).
template <int QT>
void groups_t(const uint8_t* p, const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K, float* y,
              int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = K / 32, nbp = (nb + 1) / 2, gstride = nb * a8_group_block_bytes(QT);
  // a last tile of at most REST_VEC rows after full ones: on the AVX-512 path per pair (same bits), while the
  // pair's weights are hot, instead of a tile padded to 8 rows
  const int64_t full = M / TR * TR, rest = M - full;
  const bool rest_vec = full > 0 && rest > 0 && rest <= REST_VEC;
  const int64_t tiles = rest_vec ? full / TR : (M + TR - 1) / TR;
  constexpr int qoff = QT == Q4_1 ? 32 : 16, gb = a8_group_block_bytes(QT);
  // this thread's scratch, kept between calls (a prefill's A tiles are ~1 MB): the pair's B tiles, then the A
  // tiles of every tile of rows (zeros where a block pair has no second block or a tile no row); every byte
  // is written below
  thread_local std::vector<uint8_t> raw;
  if (raw.size() < (size_t)(1024 * nbp * (tiles + 1) + 64)) raw.resize(1024 * nbp * (tiles + 1) + 64);
  uint8_t* wt = (uint8_t*)(((uintptr_t)raw.data() + 63) & ~(uintptr_t)63);
  uint8_t* at = wt + 1024 * nbp;
  if (nb % 2) std::memset(wt + 512 * nb, 0, 512);    // the last pair has no second block
  const __m256i z = _mm256_setzero_si256();
  for (int64_t t = 0; t < tiles; t++)
    for (int64_t j = 0; j < nbp; j++) {
      uint8_t* base = at + 1024 * (nbp * t + j);
      for (int64_t h = 0; h < TR; h++) {
        const int64_t r = t * TR + h;
        const int8_t* xr = xq + r * K + 64 * j;
        const __m256i lo = r < M ? _mm256_loadu_si256((const __m256i*)xr) : z;
        const __m256i hi = r < M && 2 * j + 1 < nb ? _mm256_loadu_si256((const __m256i*)(xr + 32)) : z;
        _mm512_store_si512((__m512i*)(base + 64 * h), _mm512_inserti64x4(_mm512_castsi256_si512(lo), z, 1));
        _mm512_store_si512((__m512i*)(base + 64 * (TR + h)), _mm512_inserti64x4(_mm512_castsi256_si512(z), hi, 1));
      }
    }
  // a last tile of fewer rows: its scales padded with zeros to 8 rows
  thread_local std::vector<float> pad;
  float *pd = nullptr, *ps = nullptr;
  if (rest && !rest_vec) {
    if (pad.size() < (size_t)(2 * TR * nb)) pad.resize(2 * TR * nb);
    pd = pad.data(), ps = pd + TR * nb;
    std::fill(pd, pd + 2 * TR * nb, 0.0f);
    std::memcpy(pd, xd + full * nb, rest * nb * sizeof(float));
    std::memcpy(ps, xs + full * nb, rest * nb * sizeof(float));
  }
  bool configured = false;
  for (int64_t gi = g0; gi < g1; gi++) {
    if (gi + 1 >= g1) {   // a last odd group: the AVX2 path's VNNI form (the same bits)
      vnni256::linear_groups_a8(QT, p, xq, xd, xs, M, K, y, N, gi, gi + 1);
      break;
    }
    if (!configured) configure(), configured = true;
    const uint8_t* g = p + gi * gstride;
    for (int64_t b = 0; b < nb; b++) unpack_block<QT>(g + b * gb + qoff, gstride, wt + 512 * b);
    const int valid = (int)std::min<int64_t>(16, N - 8 * gi);
    for (int64_t t = 0; t < tiles; t++) {
      const bool last = t * TR == full;
      pair_rows<QT>(g, gstride, wt, at + 1024 * nbp * t, last ? pd : xd + t * TR * nb, last ? ps : xs + t * TR * nb,
                    K, y + 8 * gi + t * TR * N, N, valid, last ? (int)rest : TR, t == 0);
    }
    if (rest_vec)
      avx512::linear_groups_a8(QT, p, xq + full * K, xd + full * nb, xs + full * nb, rest, K, y + full * N, N, gi,
                               gi + 2);
    gi++;
  }
  if (configured) _tile_release();
}

// ---- whether this process may use the tile unit ---------------------------------------------------------------
sigjmp_buf probe_env;
void probe_fault(int) { siglongjmp(probe_env, 1); }

// One small product through the tiles, checked against plain integer arithmetic; a fault (SIGILL, SIGSEGV: a
// hypervisor that reports AMX but does not run it) or a wrong result answers false.
bool probe() {
  struct sigaction sa {}, old_ill {}, old_segv {};
  sa.sa_handler = probe_fault;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGILL, &sa, &old_ill);
  sigaction(SIGSEGV, &sa, &old_segv);
  bool ok = false;
  if (sigsetjmp(probe_env, 1) == 0) {
    alignas(64) int8_t a[16 * 64];
    alignas(64) uint8_t w[16 * 64];
    alignas(64) int32_t c[16 * 16];
    for (int i = 0; i < 16 * 64; i++) a[i] = (int8_t)((i * 37) % 255 - 127), w[i] = (uint8_t)((i * 11) % 16);
    configure();
    _tile_zero(0);
    _tile_loadd(2, a, 64);
    _tile_loadd(4, w, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, c, 64);
    _tile_release();
    ok = true;
    for (int m = 0; m < 16 && ok; m++)
      for (int n = 0; n < 16 && ok; n++) {
        int32_t e = 0;
        for (int k = 0; k < 64; k++) e += (int32_t)a[m * 64 + k] * (int32_t)w[(k / 4) * 64 + 4 * n + k % 4];
        ok = e == c[m * 16 + n];
      }
  }
  sigaction(SIGILL, &old_ill, nullptr);
  sigaction(SIGSEGV, &old_segv, nullptr);
  return ok;
}

}  // namespace

bool available() {
  static const bool ok = [] {
    const char* env = std::getenv("PEAGLE_AMX");
    if (env && std::strcmp(env, "0") == 0) return false;                       // the user's switch
#if defined(__linux__)
    const unsigned d = cpuid7_edx();
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;                    // AMX-TILE, AMX-INT8
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;                          // the OS saves the tile state
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;      // Linux asks for it per process
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
    return probe();
#else
    return false;
#endif
  }();
  return ok;
}

void linear_groups_a8(int qtype, const uint8_t* packed, const int8_t* xq, const float* xd, const float* xs,
                      int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  if (qtype == Q4_0) return groups_t<Q4_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  if (qtype == Q4_1) return groups_t<Q4_1>(packed, xq, xd, xs, M, K, y, N, g0, g1);
  return groups_t<Q8_0>(packed, xq, xd, xs, M, K, y, N, g0, g1);
}

}  // namespace amx
}  // namespace peagle_quant
