// Native CPU decode attention over the paged KV cache (engine/layers/cpu_attention.py calls it).
//
// Why: on CPU, decode attention is memory-bound. The pure-torch path gathers each sequence's blocks into a
// padded batch (read + write) and SDPA reads that copy again; this kernel reads every cached K/V row once,
// straight from the blocks (AVX2/FMA for head_dim 64 and 128, portable loops otherwise): ~15x faster than
// the gather + SDPA path per layer at 128 sequences of ~170 tokens on 2 cores (2.3 ms vs 34 ms). It handles
// decode tokens (one query per sequence); prefill chunks keep the SDPA path.
//
// out/q [S, H, D] (one query per sequence, at position seq_lens[s] - 1); k_cache/v_cache [NB, BS, Hkv, D];
// block_tables [S, MB] int32; seq_lens [S] int32. Query head h reads kv head h / (H / Hkv).
// Element type float32 or bfloat16 (q, caches and out alike); scores, softmax and accumulation are float32,
// so a bf16 cache only halves the bytes read (decode attention is memory-bound).
// paged_decode_attention_quantized reads a cache of int8 / u8 codes with float32 params [NB, BS, Hkv, P]
// beside them (layers/kv_quant.py's formats: P = 1 scale, or 2 scale and zero point), a quarter / half the
// bytes of fp32 / bf16: value = code * scale (+ zero point), applied in registers.
//
// Paths (issue 34): AVX-512 where the build has it (-march=native; the CPU flags are in the build key), with
// avx512_bf16's dot products for q.k over bf16 keys; AVX2/FMA (the same block-by-block walk in 8 lanes, every
// cache type: fp32, bf16, int8 / u8 codes); portable loops. set_decode_attention_isa caps the path at run
// time (A/B benches, tests of every path on one machine).

#include "cpu_kernels.h"

#include <atomic>

namespace {

// The kernel paths, slowest first; the best one this build has is kBest.
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr int kBest = kAvx512Bf16;
#elif defined(__AVX512F__)
constexpr int kBest = kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kBest = kAvx2;
#else
constexpr int kBest = kGeneric;
#endif
constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512", "avx512_bf16"};
std::atomic<int> g_isa{kBest};  // the path the kernels take now (<= kBest)

// One (sequence, kv head)'s view of a paged cache: rows of D elements, and (quantized) P params per row.
template <typename K>
struct CacheView {
  const K* data;
  int64_t row, block_stride, hk_off;  // elements between tokens, between blocks; this head's offset
  const float* params = nullptr;      // [NB, BS, Hkv, P] float32, or none
  int64_t num_params = 0, prow = 0, pblock = 0, phk = 0;
  const K* block(int32_t b) const { return data + b * block_stride + hk_off; }
  const float* block_params(int32_t b) const { return params ? params + b * pblock + phk : nullptr; }
};

// Software prefetch of one kv head's rows of block `b` of a sequence (nothing past its last token). Why: a
// head's rows are 1/Hkv of each token's row, strided, in blocks the block table scatters, and the hardware
// prefetchers do not follow that: without it the kernel read the cache from DRAM at ~10 GB/s against a
// 35 GB/s copy (bench/attention_bandwidth.py, a cache larger than L3, as 30 layers' caches are).
constexpr int64_t kPrefetchBlocks = 2;  // blocks ahead: ~2 KB per block of a 64-dim bf16 head, in flight

// An x86 prefetcht0 as inline asm: GCC 12 deletes a loop of __builtin_prefetch / _mm_prefetch as free of
// side effects (none was left in the object code).
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

template <typename K>
inline void prefetch_block(const CacheView<K>& c, const int32_t* table, int64_t b, int64_t L, int64_t BS,
                           int64_t row_bytes) {
  const int64_t n = std::min(BS, L - b * BS);
  if (n <= 0) return;
  const char* base = reinterpret_cast<const char*>(c.block(table[b]));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t o = 0; o < row_bytes; o += 64) prefetch_line(base + j * c.row * sizeof(K) + o);
}

}  // namespace

static inline void softmax_rows(float* scores, int64_t G, int64_t L, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] = std::exp(sg[t] - m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) sum += sg[t];
    inv_sum[g] = 1.f / sum;
  }
}

// The G query rows of one kv head as float32 [G, D] (qf), and each row's sum (qsum: u8's zero point
// enters a score as sum_d q_d * z).
template <typename T>
static inline void widen_queries(const T* qrow, int64_t q_h, int64_t G, int64_t D, float* qf, float* qsum) {
  for (int64_t g = 0; g < G; ++g) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += (qf[g * D + d] = static_cast<float>(qrow[g * q_h + d]));
    qsum[g] = s;
  }
}

// The raw dots of one block's n keys (scores [G, L], from column t0 on) -> scaled scores of the values the
// codes stand for: times scale, and for a quantized cache times each row's scale (+ its zero point's share).
template <typename K>
static inline void scale_block_scores(const CacheView<K>& kc, int32_t block, float* scores, int64_t G,
                                      int64_t L, int64_t n, float scale, const float* qsum) {
  const float* params = kc.block_params(block);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    if (params == nullptr) {
      for (int64_t i = 0; i < n; ++i) sg[i] *= scale;
    } else if (kc.num_params == 1) {
      for (int64_t i = 0; i < n; ++i) sg[i] *= scale * params[i * kc.prow];
    } else {
      for (int64_t i = 0; i < n; ++i)
        sg[i] = scale * (sg[i] * params[i * kc.prow] + qsum[g] * params[i * kc.prow + 1]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// 8 consecutive elements as float32: a bf16 is the high half of a float32, so widen and shift (exact);
// 1-byte codes are sign / zero extended to int32 and converted (exact).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 load8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(bf16* p, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = bf16(tmp[i]);  // round to nearest even, like torch's .to(bfloat16)
}

// The lane sums of 8 vectors, in order: one transpose-add tree instead of 8 horizontal reductions.
static inline __m256 reduce8x8(const __m256* h) {
  const __m256 s01 = _mm256_hadd_ps(h[0], h[1]), s23 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 s45 = _mm256_hadd_ps(h[4], h[5]), s67 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// q . k over D = 8 * D8 values, lane-wise (the caller reduces the 8 lanes).
template <int D8, typename K>
static inline __m256 dot8(const float* q, const K* k) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  for (int i = 1; i < D8; ++i) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), load8(k + 8 * i), acc);
  return acc;
}

// The weighted sum of one block's n value rows, for GT query heads and CW * 8 columns: the accumulators
// (acc, GT rows of stride D) are loaded, updated row by row in t order, and stored back. Why tiles: AVX2 has
// 16 ymm registers, so GT * CW accumulators + the GT weights + one value vector must fit; each value vector
// is converted once for the GT heads.
template <int GT, int CW, typename K>
static inline void pv_chunk(const float* weights, int64_t L, const K* v, int64_t row, int64_t n, float* acc,
                            int64_t D) {
  __m256 a[GT][CW];
  for (int gi = 0; gi < GT; ++gi)
    for (int i = 0; i < CW; ++i) a[gi][i] = _mm256_loadu_ps(acc + gi * D + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    __m256 w[GT];
    for (int gi = 0; gi < GT; ++gi) w[gi] = _mm256_broadcast_ss(weights + gi * L + j);
    for (int i = 0; i < CW; ++i) {
      const __m256 x = load8(v + j * row + 8 * i);
      for (int gi = 0; gi < GT; ++gi) a[gi][i] = _mm256_fmadd_ps(w[gi], x, a[gi][i]);
    }
  }
  for (int gi = 0; gi < GT; ++gi)
    for (int i = 0; i < CW; ++i) _mm256_storeu_ps(acc + gi * D + 8 * i, a[gi][i]);
}

// One block of values for GT heads (weights: their scores at the block's first token), all D = 8 * D8
// columns in chunks of CW vectors.
template <int D8, int GT, typename K>
static inline void pv_block(const float* weights, int64_t L, const K* v, int64_t row, int64_t n, float* acc) {
  constexpr int CW = GT == 1 ? 8 : (GT == 2 ? 4 : 2);  // GT * CW <= 8 accumulators
  static_assert(D8 % CW == 0, "the chunks tile a row");
  for (int c = 0; c < D8 / CW; ++c)
    pv_chunk<GT, CW>(weights, L, v + 8 * CW * c, row, n, acc + 8 * CW * c, 8 * D8);
}

// One (sequence, kv head), D = 8 * D8: like item_avx512, block by block with the G query heads inside the
// block, so a block's K rows (and then its V rows) are read from memory once and from L1 by the other
// heads. Quantized codes: the scores and sums are over codes; the per-row params then give the values'
// (scale; u8's zero point through the query sums for scores and the weight sums zsum for values).
template <int D8, typename T, typename K>
static void item_avx2(const T* qrow, int64_t q_h, const CacheView<K>& kc, const CacheView<K>& vc,
                      const int32_t* table, int64_t L, int64_t G, int64_t BS, float scale, float* scores,
                      float* qbuf, float* inv_sum, float* acc, T* op, int64_t o_h) {
  constexpr int D = 8 * D8;
  float* qf = qbuf;                // [G, D] float32 queries
  float* qsum = qbuf + G * D;      // [G] sums of the queries (u8's zero point: sum_d q_d * z)
  float* zsum = qsum + G;          // [G] sums of weight * zero point (u8's values)
  widen_queries(qrow, q_h, G, D, qf, qsum);
  std::fill(zsum, zsum + G, 0.f);
  constexpr int64_t row_bytes = D * sizeof(K);
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(kc, table, b, L, BS, row_bytes);
  for (int64_t t0 = 0, b = 0; t0 < L; t0 += BS, ++b) {
    const int64_t n = std::min(BS, L - t0);
    const K* base = kc.block(table[b]);
    prefetch_block(kc, table, b + kPrefetchBlocks, L, BS, row_bytes);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float* sg = scores + g * L + t0;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {  // 8 keys at once: q is loaded once per 8 rows' vectors
        __m256 dots[8];
        for (int u = 0; u < 8; ++u) dots[u] = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(base + (j + u) * kc.row));
        for (int i = 1; i < D8; ++i) {
          const __m256 qv = _mm256_loadu_ps(qg + 8 * i);
          for (int u = 0; u < 8; ++u)
            dots[u] = _mm256_fmadd_ps(qv, load8(base + (j + u) * kc.row + 8 * i), dots[u]);
        }
        _mm256_storeu_ps(sg + j, reduce8x8(dots));
      }
      for (; j < n; ++j) sg[j] = hsum(dot8<D8>(qg, base + j * kc.row));
    }
    scale_block_scores(kc, table[b], scores + t0, G, L, n, scale, qsum);
  }
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(vc, table, b, L, BS, row_bytes);  // during softmax
  softmax_rows(scores, G, L, inv_sum);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0, b = 0; t0 < L; t0 += BS, ++b) {
    const int64_t n = std::min(BS, L - t0);
    const K* base = vc.block(table[b]);
    prefetch_block(vc, table, b + kPrefetchBlocks, L, BS, row_bytes);
    const float* params = vc.block_params(table[b]);
    if (params != nullptr) {  // weight * code * scale (+ weight * zero point, summed apart)
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * L + t0;
        if (vc.num_params == 2)
          for (int64_t i = 0; i < n; ++i) zsum[g] += sg[i] * params[i * vc.prow + 1];
        for (int64_t i = 0; i < n; ++i) sg[i] *= params[i * vc.prow];
      }
    }
    for (int64_t g0 = 0; g0 < G;) {  // head tiles of 4 (8 accumulators of 2 vectors), the rest in one tile
      const int64_t gt = G - g0 >= 4 ? 4 : G - g0;
      const float* w = scores + g0 * L + t0;
      float* a = acc + g0 * D;
      switch (gt) {  // a compile-time tile: its accumulators stay in registers
        case 1: pv_block<D8, 1>(w, L, base, vc.row, n, a); break;
        case 2: pv_block<D8, 2>(w, L, base, vc.row, n, a); break;
        case 3: pv_block<D8, 3>(w, L, base, vc.row, n, a); break;
        default: pv_block<D8, 4>(w, L, base, vc.row, n, a); break;
      }
      g0 += gt;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 sc = _mm256_set1_ps(inv_sum[g]), z = _mm256_set1_ps(zsum[g] * inv_sum[g]);
    for (int i = 0; i < D8; ++i)
      store8(op + g * o_h + 8 * i, _mm256_fmadd_ps(_mm256_loadu_ps(acc + g * D + 8 * i), sc, z));
  }
}
#endif

#if defined(__AVX512F__)
// ---- AVX-512 (issue 34): 16 lanes, 8 keys reduced together, the G query heads of a kv head per key load ----
// Also reads 1-byte codes (int8 / u8 with per-(token, head) params): a code row is dequantized in registers,
// so the quantized cache reads half the bytes of bf16.

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {  // widen: a bf16 is the high half of a float32 (exact)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline __m512 load16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(bf16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) p[i] = bf16(tmp[i]);
#endif
}

static inline __m256 half_sum(__m512 v) {  // 16 lanes -> 8 (AVX512F only: no extractf32x8)
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The lane sums of 8 vectors, in order: one transpose-add tree instead of 8 horizontal reductions.
static inline __m256 reduce8(const __m512* a) {
  __m256 h[8];
  for (int j = 0; j < 8; ++j) h[j] = half_sum(a[j]);
  const __m256 s01 = _mm256_hadd_ps(h[0], h[1]), s23 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 s45 = _mm256_hadd_ps(h[4], h[5]), s67 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// q . k over D = 16 * D16 values: q as float32 (qf), or as bf16 pairs (qb) for avx512_bf16's dot products.
template <int D16, typename K, bool kDp>
static inline __m512 dot16(const float* qf, const bf16* qb, const K* k) {
#if defined(__AVX512BF16__)
  if constexpr (kDp) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < D16 / 2; ++i) {
      const __m512i qv = _mm512_loadu_si512(qb + 32 * i), kv = _mm512_loadu_si512(k + 32 * i);
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(qv), reinterpret_cast<__m512bh>(kv));
    }
    return acc;
  }
#endif
  (void)qb;
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf), load16(k));
  for (int i = 1; i < D16; ++i) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 16 * i), load16(k + 16 * i), acc);
  return acc;
}

// The weighted sum of values for GT query heads (scores [GT, L] already softmaxed, unnormalized).
template <int D16, int GT, typename T, typename K>
static inline void pv_tile(const float* scores, int64_t L, const CacheView<K>& vc, const int32_t* table,
                           int64_t BS, const float* inv_sum, T* op, int64_t o_h) {
  __m512 acc[GT][D16];
  float zsum[GT];
  for (int gi = 0; gi < GT; ++gi) {
    zsum[gi] = 0.f;
    for (int i = 0; i < D16; ++i) acc[gi][i] = _mm512_setzero_ps();
  }
  for (int64_t t0 = 0, b = 0; t0 < L; t0 += BS, ++b) {
    const int64_t n = std::min(BS, L - t0);
    const K* base = vc.block(table[b]);
    const float* params = vc.block_params(table[b]);
    prefetch_block(vc, table, b + kPrefetchBlocks, L, BS, 16 * D16 * sizeof(K));
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[D16];
      for (int i = 0; i < D16; ++i) v[i] = load16(base + j * vc.row + 16 * i);
      const float vs = params ? params[j * vc.prow] : 1.f;
      const float vz = (params && vc.num_params == 2) ? params[j * vc.prow + 1] : 0.f;
      for (int gi = 0; gi < GT; ++gi) {
        const float p = scores[gi * L + t0 + j];
        zsum[gi] += p * vz;
        const __m512 w = _mm512_set1_ps(p * vs);
        for (int i = 0; i < D16; ++i) acc[gi][i] = _mm512_fmadd_ps(w, v[i], acc[gi][i]);
      }
    }
  }
  for (int gi = 0; gi < GT; ++gi) {
    const __m512 sc = _mm512_set1_ps(inv_sum[gi]), z = _mm512_set1_ps(zsum[gi] * inv_sum[gi]);
    for (int i = 0; i < D16; ++i) store16(op + gi * o_h + 16 * i, _mm512_fmadd_ps(acc[gi][i], sc, z));
  }
}

// One (sequence, kv head): scores, softmax, then the weighted sum of values, for its G query heads.
template <int D16, typename T, typename K, bool kDp>
static void item_avx512(const T* qrow, int64_t q_h, const CacheView<K>& kc, const CacheView<K>& vc,
                        const int32_t* table, int64_t L, int64_t G, int64_t BS, float scale, float* scores,
                        float* qbuf, float* inv_sum, T* op, int64_t o_h) {
  constexpr int D = 16 * D16;
  float* qf = qbuf;       // [G, D] float32 queries
  float* qsum = qbuf + G * D;  // [G] sums of the queries (u8's zero point: sum_d q_d * z)
  widen_queries(qrow, q_h, G, D, qf, qsum);
  const bf16* qb = reinterpret_cast<const bf16*>(qrow);  // kDp: T is bf16
  constexpr int64_t row_bytes = D * sizeof(K);
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(kc, table, b, L, BS, row_bytes);
  for (int64_t t0 = 0, b = 0; t0 < L; t0 += BS, ++b) {
    const int64_t n = std::min(BS, L - t0);
    const K* base = kc.block(table[b]);
    prefetch_block(kc, table, b + kPrefetchBlocks, L, BS, row_bytes);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = dot16<D16, K, kDp>(qf + g * D, qb + g * q_h, base + (j + u) * kc.row);
        _mm256_storeu_ps(scores + g * L + t0 + j, reduce8(acc));
      }
    }
    for (; j < n; ++j)
      for (int64_t g = 0; g < G; ++g)
        scores[g * L + t0 + j] = _mm512_reduce_add_ps(dot16<D16, K, kDp>(qf + g * D, qb + g * q_h, base + j * kc.row));
    scale_block_scores(kc, table[b], scores + t0, G, L, n, scale, qsum);
  }
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(vc, table, b, L, BS, row_bytes);  // during softmax
  softmax_rows(scores, G, L, inv_sum);
  constexpr int kMaxTile = 24 / D16;  // accumulators kept in registers: tile * D16 of the 32 zmm
  for (int64_t g0 = 0; g0 < G; g0 += kMaxTile) {
    const float* sg = scores + g0 * L;
    T* o = op + g0 * o_h;
    switch (std::min<int64_t>(kMaxTile, G - g0)) {  // a compile-time tile: its accumulators stay in registers
      case 1: pv_tile<D16, 1>(sg, L, vc, table, BS, inv_sum + g0, o, o_h); break;
      case 2: pv_tile<D16, 2>(sg, L, vc, table, BS, inv_sum + g0, o, o_h); break;
      case 3: pv_tile<D16, 3>(sg, L, vc, table, BS, inv_sum + g0, o, o_h); break;
      default:
        if constexpr (kMaxTile >= 6) {
          const int64_t gt = std::min<int64_t>(kMaxTile, G - g0);
          if (gt == 4) pv_tile<D16, 4>(sg, L, vc, table, BS, inv_sum + g0, o, o_h);
          else if (gt == 5) pv_tile<D16, 5>(sg, L, vc, table, BS, inv_sum + g0, o, o_h);
          else pv_tile<D16, 6>(sg, L, vc, table, BS, inv_sum + g0, o, o_h);
        }
    }
  }
}
#endif

template <typename T, typename K>
static void item_generic(const T* qrow, int64_t q_h, const CacheView<K>& kc, const CacheView<K>& vc,
                         const int32_t* table, int64_t L, int64_t G, int64_t D, int64_t BS, float scale,
                         float* scores, float* inv_sum, float* acc, T* op, int64_t o_h) {
  for (int64_t t = 0; t < L; ++t) {
    const K* k = kc.block(table[t / BS]) + (t % BS) * kc.row;
    const float* p = kc.block_params(table[t / BS]);
    const float ks = p ? p[(t % BS) * kc.prow] : 1.f;
    const float kz = (p && kc.num_params == 2) ? p[(t % BS) * kc.prow + 1] : 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const T* qg = qrow + g * q_h;
      float dot = 0.f, qsum = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        dot += static_cast<float>(qg[d]) * static_cast<float>(k[d]);
        qsum += static_cast<float>(qg[d]);
      }
      scores[g * L + t] = (dot * ks + qsum * kz) * scale;
    }
  }
  softmax_rows(scores, G, L, inv_sum);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const K* v = vc.block(table[t / BS]) + (t % BS) * vc.row;
    const float* p = vc.block_params(table[t / BS]);
    const float vs = p ? p[(t % BS) * vc.prow] : 1.f;
    const float vz = (p && vc.num_params == 2) ? p[(t % BS) * vc.prow + 1] : 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * L + t];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * (static_cast<float>(v[d]) * vs + vz);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) op[g * o_h + d] = T(acc[g * D + d] * inv_sum[g]);
}

// A work item's fixed cost, in cached tokens' worth (its queries widened, softmax set up, output written).
constexpr int64_t kItemOverheadTokens = 16;

// The S * Hkv (sequence, kv head) items cut into at most `parts` contiguous runs of near-equal cost (each
// item costs its sequence's length plus kItemOverheadTokens): run i is items [bounds[i], bounds[i + 1]).
// Each cut goes on whichever side of the item holding its share's end is nearer that end. Why: at::
// parallel_for splits a range into equal counts, and the running list is in admission order, so the first
// half of a batch holds the oldest, longest sequences: with lengths falling from 600 to 50 tokens one
// thread did 71% of the reads while the other waited (bench/attention_bandwidth.py --skew).
static std::vector<int64_t> balanced_bounds(const int32_t* lens, int64_t S, int64_t Hkv, int64_t parts) {
  const int64_t items = S * Hkv;
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) total += (lens[s] + kItemOverheadTokens) * Hkv;
  std::vector<int64_t> bounds{0};
  int64_t done = 0, share = 1;  // cost of items [0, item); the next cut ends share `share` of `parts`
  for (int64_t item = 0; item < items && share < parts; ++item) {
    const int64_t cost = lens[item / Hkv] + kItemOverheadTokens;
    for (; share < parts && (done + cost) * parts >= total * share; ++share) {
      const bool nearer_before = total * share - done * parts < (done + cost) * parts - total * share;
      const int64_t cut = nearer_before ? item : item + 1;
      if (cut > bounds.back()) bounds.push_back(cut);
    }
    done += cost;
  }
  if (bounds.back() != items) bounds.push_back(items);
  return bounds;
}

template <typename T, typename K>
static void decode_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const c10::optional<torch::Tensor>& k_params,
                        const c10::optional<torch::Tensor>& v_params, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_lens, double scale) {
  const int64_t S = q.size(0), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = q.size(1) / Hkv, MB = block_tables.size(1);
  const int64_t P = k_params.has_value() ? k_params->size(3) : 0;
  const T* qp = q.data_ptr<T>();
  const K* kp = k_cache.data_ptr<K>();
  const K* vp = v_cache.data_ptr<K>();
  const float* kpp = k_params.has_value() ? k_params->data_ptr<float>() : nullptr;
  const float* vpp = v_params.has_value() ? v_params->data_ptr<float>() : nullptr;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_s = q.stride(0), q_h = q.stride(1), o_s = out.stride(0), o_h = out.stride(1);
  const int64_t row = Hkv * D, block_stride = BS * Hkv * D;
  const float fscale = static_cast<float>(scale);
  const int isa = g_isa.load(std::memory_order_relaxed);
  const std::vector<int64_t> bounds = balanced_bounds(lens, S, Hkv, std::max(1, at::get_num_threads()));
  at::parallel_for(0, int64_t(bounds.size()) - 1, 1, [&](int64_t run0, int64_t run1) {
    std::vector<float> scores, acc(G * D), inv_sum(G), qbuf(G * D + 2 * G);
    for (int64_t item = bounds[run0]; item < bounds[run1]; ++item) {
      const int64_t s = item / Hkv, hk = item % Hkv, L = lens[s];
      scores.resize(G * L);
      const T* qrow = qp + s * q_s + hk * G * q_h;
      T* orow = op + s * o_s + hk * G * o_h;
      const int32_t* table = bt + s * MB;
      CacheView<K> kc{kp, row, block_stride, hk * D, kpp, P, Hkv * P, BS * Hkv * P, hk * P};
      CacheView<K> vc{vp, row, block_stride, hk * D, vpp, P, Hkv * P, BS * Hkv * P, hk * P};
#if defined(__AVX512F__)
      if (isa >= kAvx512 && (D == 64 || D == 128)) {
        constexpr bool dp = std::is_same_v<T, bf16> && std::is_same_v<K, bf16>;
        auto run = [&](auto d16, auto use_dp) {
          item_avx512<decltype(d16)::value, T, K, decltype(use_dp)::value>(
              qrow, q_h, kc, vc, table, L, G, BS, fscale, scores.data(), qbuf.data(), inv_sum.data(), orow, o_h);
        };
        using D4 = std::integral_constant<int, 4>;
        using D8 = std::integral_constant<int, 8>;
        using Dp = std::integral_constant<bool, dp>;
        using NoDp = std::false_type;
        if (dp && isa >= kAvx512Bf16) {
          if (D == 64) run(D4{}, Dp{}); else run(D8{}, Dp{});
        } else {
          if (D == 64) run(D4{}, NoDp{}); else run(D8{}, NoDp{});
        }
        continue;
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if (isa >= kAvx2 && (D == 64 || D == 128)) {
        if (D == 64)
          item_avx2<8, T, K>(qrow, q_h, kc, vc, table, L, G, BS, fscale, scores.data(), qbuf.data(), inv_sum.data(),
                             acc.data(), orow, o_h);
        else
          item_avx2<16, T, K>(qrow, q_h, kc, vc, table, L, G, BS, fscale, scores.data(), qbuf.data(),
                              inv_sum.data(), acc.data(), orow, o_h);
        continue;
      }
#endif
      item_generic<T, K>(qrow, q_h, kc, vc, table, L, G, D, BS, fscale, scores.data(), inv_sum.data(),
                         acc.data(), orow, o_h);
    }
  });
}

static void check_common(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                         const torch::Tensor& seq_lens) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 queries only");
  TORCH_CHECK(out.scalar_type() == dtype, "q and out must share one dtype");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous(), "contiguous caches and tables");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out need a contiguous last dim");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes disagree");
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  check_common(out, q, k_cache, v_cache, block_tables, seq_lens);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype, "q, k_cache, v_cache and out must share one dtype");
  const c10::optional<torch::Tensor> none;
  if (dtype == at::kFloat) {
    decode_impl<float, float>(out, q, k_cache, v_cache, none, none, block_tables, seq_lens, scale);
  } else {
    decode_impl<bf16, bf16>(out, q, k_cache, v_cache, none, none, block_tables, seq_lens, scale);
  }
}

void paged_decode_attention_quantized(torch::Tensor out, torch::Tensor q, torch::Tensor k_codes,
                                      torch::Tensor v_codes, torch::Tensor k_params, torch::Tensor v_params,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  check_common(out, q, k_codes, v_codes, block_tables, seq_lens);
  const auto codes = k_codes.scalar_type();
  TORCH_CHECK(codes == at::kChar || codes == at::kByte, "int8 or uint8 codes only");
  TORCH_CHECK(k_params.scalar_type() == at::kFloat && v_params.scalar_type() == at::kFloat &&
              k_params.is_contiguous() && v_params.is_contiguous(), "contiguous float32 params");
  TORCH_CHECK(k_params.dim() == 4 && k_params.sizes() == v_params.sizes() &&
              k_params.size(0) == k_codes.size(0) && k_params.size(1) == k_codes.size(1) &&
              k_params.size(2) == k_codes.size(2) && (k_params.size(3) == 1 || k_params.size(3) == 2),
              "params [NB, BS, Hkv, 1 or 2]");
  const c10::optional<torch::Tensor> kp(k_params), vp(v_params);
  if (q.scalar_type() == at::kFloat) {
    if (codes == at::kChar)
      decode_impl<float, int8_t>(out, q, k_codes, v_codes, kp, vp, block_tables, seq_lens, scale);
    else
      decode_impl<float, uint8_t>(out, q, k_codes, v_codes, kp, vp, block_tables, seq_lens, scale);
  } else {
    if (codes == at::kChar)
      decode_impl<bf16, int8_t>(out, q, k_codes, v_codes, kp, vp, block_tables, seq_lens, scale);
    else
      decode_impl<bf16, uint8_t>(out, q, k_codes, v_codes, kp, vp, block_tables, seq_lens, scale);
  }
}

std::string set_decode_attention_isa(const std::string& name) {
  int want = kBest;
  if (name != "auto" && name != "best") {
    const auto* found = std::find(std::begin(kIsaNames), std::end(kIsaNames), name);
    TORCH_CHECK(found != std::end(kIsaNames), "unknown path ", name, ": auto, generic, avx2, avx512, avx512_bf16");
    want = std::min<int>(static_cast<int>(found - std::begin(kIsaNames)), kBest);
  }
  g_isa.store(want);
  return kIsaNames[want];
}

std::string decode_attention_isa() { return kIsaNames[g_isa.load()]; }

std::vector<int64_t> decode_attention_runs(torch::Tensor seq_lens, int64_t kv_heads, int64_t parts) {
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "int32 sequence lengths");
  TORCH_CHECK(kv_heads > 0 && parts > 0, "kv_heads and parts must be positive");
  return balanced_bounds(seq_lens.data_ptr<int32_t>(), seq_lens.size(0), kv_heads, parts);
}
