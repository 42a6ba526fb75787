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

#include "cpu_kernels.h"

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

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// 8 consecutive elements as float32: a bf16 is the high half of a float32, so widen and shift (exact).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(bf16* p, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = bf16(tmp[i]);  // round to nearest even, like torch's .to(bfloat16)
}

// One (sequence, kv head): D = 8 * D8.
template <int D8, typename T>
static void item_avx2(const T* qrow, int64_t q_h, const T* kp, const T* vp, const int32_t* table, int64_t L,
                      int64_t G, int64_t BS, int64_t row, int64_t block_stride, int64_t hk_off, float scale,
                      float* scores, float* inv_sum, T* op, int64_t o_h) {
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[D8];
    const __m256 sc = _mm256_set1_ps(scale);
    for (int i = 0; i < D8; ++i) qv[i] = _mm256_mul_ps(load8(qrow + g * q_h + 8 * i), sc);
    float* sg = scores + g * L;
    for (int64_t t = 0; t < L; ++t) {
      const T* k = kp + table[t / BS] * block_stride + (t % BS) * row + hk_off;
      __m256 acc = _mm256_mul_ps(qv[0], load8(k));
      for (int i = 1; i < D8; ++i) acc = _mm256_fmadd_ps(qv[i], load8(k + 8 * i), acc);
      sg[t] = hsum(acc);
    }
  }
  softmax_rows(scores, G, L, inv_sum);
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[D8];
    for (int i = 0; i < D8; ++i) acc[i] = _mm256_setzero_ps();
    const float* sg = scores + g * L;
    for (int64_t t = 0; t < L; ++t) {
      const T* v = vp + table[t / BS] * block_stride + (t % BS) * row + hk_off;
      const __m256 p = _mm256_set1_ps(sg[t]);
      for (int i = 0; i < D8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(inv_sum[g]);
    T* o = op + g * o_h;
    for (int i = 0; i < D8; ++i) store8(o + 8 * i, _mm256_mul_ps(acc[i], inv));
  }
}
#endif

template <typename T>
static void item_generic(const T* qrow, int64_t q_h, const T* kp, const T* vp, const int32_t* table,
                         int64_t L, int64_t G, int64_t D, int64_t BS, int64_t row, int64_t block_stride,
                         int64_t hk_off, float scale, float* scores, float* inv_sum, float* acc, T* op,
                         int64_t o_h) {
  for (int64_t t = 0; t < L; ++t) {
    const T* k = kp + table[t / BS] * block_stride + (t % BS) * row + hk_off;
    for (int64_t g = 0; g < G; ++g) {
      const T* qg = qrow + g * q_h;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += static_cast<float>(qg[d]) * static_cast<float>(k[d]);
      scores[g * L + t] = dot * scale;
    }
  }
  softmax_rows(scores, G, L, inv_sum);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const T* v = vp + table[t / BS] * block_stride + (t % BS) * row + hk_off;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) op[g * o_h + d] = T(acc[g * D + d] * inv_sum[g]);
}

template <typename T>
static void decode_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_lens, double scale) {
  const int64_t S = q.size(0), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = q.size(1) / Hkv, MB = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_s = q.stride(0), q_h = q.stride(1), o_s = out.stride(0), o_h = out.stride(1);
  const int64_t row = Hkv * D, block_stride = BS * Hkv * D;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), inv_sum(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / Hkv, hk = item % Hkv, L = lens[s];
      scores.resize(G * L);
      const T* qrow = qp + s * q_s + hk * G * q_h;
      T* orow = op + s * o_s + hk * G * o_h;
      const int32_t* table = bt + s * MB;
#if defined(__AVX2__) && defined(__FMA__)
      if (D == 64) {
        item_avx2<8, T>(qrow, q_h, kp, vp, table, L, G, BS, row, block_stride, hk * D, fscale, scores.data(),
                        inv_sum.data(), orow, o_h);
        continue;
      }
      if (D == 128) {
        item_avx2<16, T>(qrow, q_h, kp, vp, table, L, G, BS, row, block_stride, hk * D, fscale,
                         scores.data(), inv_sum.data(), orow, o_h);
        continue;
      }
#endif
      item_generic<T>(qrow, q_h, kp, vp, table, L, G, D, BS, row, block_stride, hk * D, fscale,
                      scores.data(), inv_sum.data(), acc.data(), orow, o_h);
    }
  });
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 tensors only");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "q, k_cache, v_cache and out must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous(), "contiguous caches and tables");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out need a contiguous last dim");
  if (dtype == at::kFloat) {
    decode_impl<float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  } else {
    decode_impl<bf16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  }
}
