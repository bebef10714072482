// The blocked form of attend_impl.h's exact attention (its vector builds, hd 64 / 128) and those builds' entry
// points: included at the end of attend_impl.h where PEAGLE_ATTEND_AVX2 is defined. Per query the operations and
// their order are attend_range's, so the same bits.
#pragma once

namespace peagle_attend {

#ifdef PEAGLE_ATTEND_AVX512
// Which of the 16 keys at m are visible (a mask row's bools, any nonzero byte as the other paths read it: bit k
// set for key k).
static inline __mmask16 visible16(const uint8_t* m) {
  const __m128i v = _mm_loadu_si128((const __m128i*)m);
  return _mm_test_epi8_mask(v, v);
}

// Queries qa, qb against 8 keys (k0, kstride apart): the 16 dot8 values, each exactly dot8's (lane l of a half
// sums elements 8i + l by fma in order; the fold 4+4, 2+2, 1+1 done for all 16 at once by shuffles, each add
// the same pair of values as dot8's), times scale. out_a[j], out_b[j] for j < 8 (the scores stored once: a
// vector load of scalars or halves just stored would wait for them, no store forwarding across them).
template <int HD, typename KV>
static inline void dot8_pair8(const float* qa, const float* qb, const KV* k0, int64_t kstride, float* out_a,
                              float* out_b, float scale) {
  __m512 acc[8];
  #pragma GCC unroll 8
  for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
  #pragma GCC unroll 16
  for (int c = 0; c < HD / 8; c++) {
    const __m512 qv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + 8 * c)),
                                         _mm256_loadu_ps(qb + 8 * c), 1);
    #pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
      acc[j] = _mm512_fmadd_ps(qv, _mm512_broadcast_f32x8(kv_ld8(k0 + j * kstride + 8 * c)), acc[j]);
  }
  // 128-bit lanes of acc[j]: [a 0-3, a 4-7, b 0-3, b 4-7]; step 1: lanes 0-3 + lanes 4-7 of each half
  __m512 p[4];
  #pragma GCC unroll 4
  for (int k = 0; k < 4; k++)
    p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // p[k] lanes: [a key 2k, b key 2k, a key 2k+1, b key 2k+1] (4 partial sums each); step 2: elements 0+2, 1+3
  __m512 r[2];
  #pragma GCC unroll 2
  for (int k = 0; k < 2; k++)
    r[k] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * k], p[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(p[2 * k], p[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // step 3: elements 0+1, 2+3 -> lane L element k: sum of p[k]'s lane L
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // f[4L + k] = lane L of p[k]: L 0 = (a, key 2k), 1 = (b, 2k), 2 = (a, 2k+1), 3 = (b, 2k+1)
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512 g = _mm512_mul_ps(_mm512_permutexvar_ps(order, f), _mm512_set1_ps(scale));
  _mm256_storeu_ps(out_a, _mm512_castps512_ps256(g));
  _mm256_storeu_ps(out_b, _mm512_extractf32x8_ps(g, 1));
}
#endif

// Blocked form for hd = HD (64 or 128): the queries that share a kv head (b, g) -- T x group of them, in tasks
// of up to QB -- meet each chunk of KC keys while it is in L1, instead of every query streaming all keys. Per
// query the operations and their order are attend_range's: each visible key's dot8 in ascending order, the max,
// exp_neg, l and o summed over visible keys in ascending order (o: one fma chain per element).
constexpr int64_t QB = 8, KC = 16;

// Tasks: each kv head's (b, g) T x group queries in p blocks of whole pairs (the AVX-512 path's unit), at most QB
// queries each. Fewer than 8 tasks in all: a pair per task (a decode step of one row: SmolLM2's 3 kv heads gave 3
// tasks, 2 : 1 over 2 threads; on a 2-core Intel Xeon, SmolLM2 q4a8 in the engine, the plain step 2.956 -> 2.871
// ms, P-EAGLE K=1 4.514 -> 4.287 ms). An odd count of tasks made one more (9 blocks of 8 for a verify of 8 rows
// ran 40 : 32 queries over 2 threads; 12 of 6 run 36 : 36). And the tasks are taken zig-zag (first, last, second,
// next to last, ...), so at::parallel_for's contiguous shares get as much work where it grows along a head's
// blocks: a causal prefill's later queries see more keys (in head order the second thread's half of a 3-head
// prefill did 1.75 / 1.25 of the first's). Per query the same operations wherever it runs (the same bits).
inline int64_t head_blocks(const AttnArgs& a) {
  const int64_t nq = a.T * (a.nh / a.nkv), pairs = (nq + 1) / 2, heads = a.B * a.nkv;
  int64_t p = (nq + QB - 1) / QB;
  if (heads * p < 8) p = pairs;
  if (heads * p % 2 && p < pairs) p++;
  return p;
}
inline int64_t blocked_tasks(const AttnArgs& a) { return a.B * a.nkv * head_blocks(a); }

template <int HD, typename KV>
static inline void attend_blocked(const AttnArgs& a, int64_t task0, int64_t task1) {
  const int64_t group = a.nh / a.nkv, nq_all = a.T * group, pairs = (nq_all + 1) / 2, p = head_blocks(a);
  const int64_t n = a.B * a.nkv * p, S = a.S;
  std::vector<float> sc(QB * S), os(QB * HD);
  for (int64_t u = task0; u < task1; u++) {
    const int64_t task = u % 2 ? n - 1 - u / 2 : u / 2, blk = task % p;   // zig-zag
    const int64_t b = task / (a.nkv * p), g = (task / p) % a.nkv;
    // block blk: pairs blk * pairs / p .. (blk + 1) * pairs / p - 1 (at most QB / 2 of them: p >= nq_all / QB)
    const int64_t qa = 2 * (blk * pairs / p), nq = std::min(nq_all, 2 * ((blk + 1) * pairs / p)) - qa;
    const KV* kb = (const KV*)a.k + b * a.ksb + g * a.ksg;
    const KV* vb = (const KV*)a.v + b * a.ksb + g * a.ksg;
    int64_t idx[QB];
    const uint8_t* mrow[QB];
    for (int64_t i = 0; i < nq; i++) {
      const int64_t t = (qa + i) / group, h = g * group + (qa + i) % group;
      idx[i] = (b * a.T + t) * a.nh + h;
      mrow[i] = a.mask ? a.mask + b * a.msb + t * a.mst : nullptr;
    }
    // Se: one past the last key any of the task's queries sees. The keys after it are skipped: a hidden key's
    // score, e^x and (masked-off) fma change no query's max, l or o, so the bits are the same; a causal block's
    // queries see about half of its span (a prompt's prefill)
    int64_t Se = a.mask ? 0 : S;
    for (int64_t i = 0; a.mask && i < nq; i++)
      for (int64_t j = S; j > Se; j--)
        if (mrow[i][j - 1]) {
          Se = j;
          break;
        }
    // scores of every key below Se (a hidden one among them computed and never used)
    for (int64_t j0 = 0; j0 < Se; j0 += KC) {
      const int64_t j1 = j0 + KC < Se ? j0 + KC : Se;
      int64_t i0 = 0;
#ifdef PEAGLE_ATTEND_AVX512
      for (; i0 + 2 <= nq; i0 += 2) {          // pairs of queries, 8 keys at a time
        const float *qa = a.q + idx[i0] * HD, *qb = a.q + idx[i0 + 1] * HD;
        float *sa = sc.data() + i0 * S, *sb = sa + S;
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) dot8_pair8<HD, KV>(qa, qb, kb + j * a.ksj, a.ksj, sa + j, sb + j, a.scale);
        for (; j < j1; j++)
          sa[j] = dot8(qa, kb + j * a.ksj, HD) * a.scale, sb[j] = dot8(qb, kb + j * a.ksj, HD) * a.scale;
      }
#endif
      for (int64_t i = i0; i < nq; i++) {
        const float* q = a.q + idx[i] * HD;
        float* si = sc.data() + i * S;
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4)
          dot8x4(q, kb + j * a.ksj, kb + (j + 1) * a.ksj, kb + (j + 2) * a.ksj, kb + (j + 3) * a.ksj, HD, a.scale,
                 si + j);
        for (; j < j1; j++) si[j] = dot8(q, kb + j * a.ksj, HD) * a.scale;
      }
    }
    // per query: the max over its visible keys (exact in any order; 16 or 8 lanes, a hidden key left out),
    // then exp; l, the sum of the visible p_j in key order, is added up in the value loop below (same order)
    float l[QB], mx[QB];
    __m256 o[HD / 8];
    for (int64_t i = 0; i < nq; i++) mx[i] = -INFINITY, l[i] = 0.0f;
#ifdef PEAGLE_ATTEND_AVX512
    for (int64_t i = 0; i < nq; i++) {
      const float* si = sc.data() + i * S;
      __m512 m16 = _mm512_set1_ps(-INFINITY);
      int64_t j = 0;
      for (; j + 16 <= Se; j += 16) {
        const __mmask16 k = mrow[i] ? visible16(mrow[i] + j) : (__mmask16)0xffff;
        m16 = _mm512_mask_max_ps(m16, k, _mm512_loadu_ps(si + j), m16);   // a NaN score: m16 kept (as attend_range)
      }
      float m = _mm512_reduce_max_ps(m16);
      for (; j < Se; j++)
        if ((!mrow[i] || mrow[i][j]) && si[j] > m) m = si[j];
      mx[i] = m;
    }
#else
    for (int64_t i = 0; i < nq; i++) {             // 8 lanes: a hidden key's score replaced by -inf
      const float* si = sc.data() + i * S;
      const __m256 ninf = _mm256_set1_ps(-INFINITY);
      __m256 m8 = ninf;
      int64_t j = 0;
      for (; j + 8 <= Se; j += 8) {
        __m256 v = _mm256_loadu_ps(si + j);
        if (mrow[i]) {
          const __m256i vis = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mrow[i] + j)));
          v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, _mm256_setzero_si256())));
        }
        m8 = _mm256_max_ps(v, m8);                  // a NaN score: m8 kept (as attend_range)
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m8);
      float m = lanes[0];
      for (int c = 1; c < 8; c++) m = lanes[c] > m ? lanes[c] : m;
      for (; j < Se; j++)
        if ((!mrow[i] || mrow[i][j]) && si[j] > m) m = si[j];
      mx[i] = m;
    }
#endif
    for (int64_t i = 0; i < nq; i++) {
      float* si = sc.data() + i * S;
      const uint8_t* mr = mrow[i];
      if (mr) {                                     // a hidden key's score := the max: unused; keeps exp's
        int64_t j = 0;                              // argument in range
#ifdef PEAGLE_ATTEND_AVX512
        const __m512 mv = _mm512_set1_ps(mx[i]);
        for (; j + 16 <= Se; j += 16)
          _mm512_mask_storeu_ps(si + j, (__mmask16)~visible16(mr + j), mv);
#endif
        for (; j < Se; j++)
          if (!mr[j]) si[j] = mx[i];
      }
      exp_shifted(si, Se, mx[i]);
    }
    // o per query, keys chunk by chunk (each chunk's values shared by all the task's queries while in L1)
    std::fill(os.begin(), os.begin() + nq * HD, 0.0f);
    for (int64_t j0 = 0; j0 < Se; j0 += KC) {
      const int64_t j1 = j0 + KC < Se ? j0 + KC : Se;
      for (int64_t i = 0; i < nq; i++) {
        const float* si = sc.data() + i * S;
        const uint8_t* mr = mrow[i];
        float* oi = os.data() + i * HD;
#ifdef PEAGLE_ATTEND_AVX512
        // two queries at once (each element's fma chain as one query's; a hidden key's fma masked off: no
        // operation, as the loop below skips it), the last odd query alone
        const int64_t nz = i + 1 < nq ? 2 : 1;
        const float* sj = sc.data() + (i + nz - 1) * S;
        const uint8_t* mj = mrow[i + nz - 1];
        float* oj = os.data() + (i + nz - 1) * HD;
        __m512 oz[2][HD / 16];
        #pragma GCC unroll 8
        for (int c = 0; c < HD / 16; c++) {
          oz[0][c] = _mm512_loadu_ps(oi + 16 * c);
          oz[1][c] = _mm512_loadu_ps(oj + 16 * c);
        }
        const int64_t ks = a.ksj;
        float la = l[i], lb = l[i + nz - 1];
        // every key of the chunk visible to the query (or queries): the same fma and adds without the masks
        // (a full mask is a plain fma), and no second query's masked-off fma when there is one query. The three
        // cases are guarded loops: as an if / else chain GCC's code ran 4-6 % slower at 9-17 queries (measured)
        const auto all_visible = [&](const uint8_t* m) {
          if (!m) return true;
          if (j1 - j0 == 16) return visible16(m + j0) == 0xffff;
          for (int64_t j = j0; j < j1; j++)
            if (!m[j]) return false;
          return true;
        };
        const bool open = all_visible(mr) && (nz == 1 || all_visible(mj));
        for (int64_t j = j0; open && nz == 2 && j < j1; j++) {
          la += si[j];
          lb += sj[j];
          const __m512 pa = _mm512_set1_ps(si[j]), pb = _mm512_set1_ps(sj[j]);
          const KV* v = vb + j * ks;
          #pragma GCC unroll 8
          for (int c = 0; c < HD / 16; c++) {
            const __m512 vv = kv_ld16(v + 16 * c);
            oz[0][c] = _mm512_fmadd_ps(pa, vv, oz[0][c]);
            oz[1][c] = _mm512_fmadd_ps(pb, vv, oz[1][c]);
          }
        }
        for (int64_t j = j0; open && nz == 1 && j < j1; j++) {
          la += si[j];
          const __m512 pa = _mm512_set1_ps(si[j]);
          const KV* v = vb + j * ks;
          #pragma GCC unroll 8
          for (int c = 0; c < HD / 16; c++) oz[0][c] = _mm512_fmadd_ps(pa, kv_ld16(v + 16 * c), oz[0][c]);
        }
        for (int64_t j = j0; !open && j < j1; j++) {
          const bool va = !mr || mr[j], vb2 = nz == 2 && (!mj || mj[j]);
          const __mmask16 ka = va ? 0xffff : 0, kb2 = vb2 ? 0xffff : 0;
          la += va ? si[j] : 0.0f;                  // +0.0f: a sum of non-negative terms unchanged
          lb += vb2 ? sj[j] : 0.0f;
          const __m512 pa = _mm512_set1_ps(si[j]), pb = _mm512_set1_ps(sj[j]);
          const KV* v = vb + j * ks;
          #pragma GCC unroll 8
          for (int c = 0; c < HD / 16; c++) {
            const __m512 vv = kv_ld16(v + 16 * c);
            oz[0][c] = _mm512_mask3_fmadd_ps(pa, vv, oz[0][c], ka);
            oz[1][c] = _mm512_mask3_fmadd_ps(pb, vv, oz[1][c], kb2);
          }
        }
        l[i] = la;
        if (nz == 2) l[i + 1] = lb;
        #pragma GCC unroll 8
        for (int c = 0; c < HD / 16; c++) {
          _mm512_storeu_ps(oi + 16 * c, oz[0][c]);
          if (nz == 2) _mm512_storeu_ps(oj + 16 * c, oz[1][c]);
        }
        i += nz - 1;
        continue;
#endif
        #pragma GCC unroll 16
        for (int c = 0; c < HD / 8; c++) o[c] = _mm256_loadu_ps(oi + 8 * c);
        for (int64_t j = j0; j < j1; j++) {
          if (mr && !mr[j]) continue;
          l[i] += si[j];
          const __m256 pv = _mm256_set1_ps(si[j]);
          const KV* v = vb + j * a.ksj;
          #pragma GCC unroll 16
          for (int c = 0; c < HD / 8; c++) o[c] = _mm256_fmadd_ps(pv, kv_ld8(v + 8 * c), o[c]);
        }
        #pragma GCC unroll 16
        for (int c = 0; c < HD / 8; c++) _mm256_storeu_ps(oi + 8 * c, o[c]);
      }
    }
    for (int64_t i = 0; i < nq; i++) {
      bool any = Se > 0 && !mrow[i];
      for (int64_t j = 0; mrow[i] && j < Se && !any; j++) any = mrow[i][j];
      const float inv = any ? 1.0f / l[i] : 0.0f;
      float* dst = a.out + idx[i] * HD;
      const float* oi = os.data() + i * HD;
      for (int64_t c = 0; c < HD; c++) dst[c] = (any ? oi[c] : 0.0f) * inv;
    }
  }
}

#ifdef PEAGLE_ATTEND_NS
// The entry points of a vector build (PEAGLE_ATTEND_NS: avx2 or avx512; ops.cpp declares them): tasks are
// attend_blocked's for hd 64 / 128, else one per query (attend_range).
namespace PEAGLE_ATTEND_NS {
int64_t tasks(const AttnArgs& a) { return a.hd == 64 || a.hd == 128 ? blocked_tasks(a) : a.B * a.T * a.nh; }
void attend(const AttnArgs& a, int64_t t0, int64_t t1) {
  if (a.hd == 64) return a.kv_bf16 ? attend_blocked<64, bf16w>(a, t0, t1) : attend_blocked<64, float>(a, t0, t1);
  if (a.hd == 128) return a.kv_bf16 ? attend_blocked<128, bf16w>(a, t0, t1) : attend_blocked<128, float>(a, t0, t1);
  attend_range(a, t0, t1);
}
}  // namespace PEAGLE_ATTEND_NS
#endif

}  // namespace peagle_attend
