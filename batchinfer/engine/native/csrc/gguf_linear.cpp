// GGUF block linears (quantization="gguf": engine/layers/gguf_weights.py calls them).
//
// Why our own: torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu, whose group format would fit) ran a
// decoder layer's four linears 10x (1 row) to 60x (64 rows) slower than oneDNN fp32 on the AVX2 bench
// machine (torch 2.13; its fast path is AVX-512), and it has no Q8_0. These keep the GGUF blocks (Q4_0 / Q4_1:
// 4-bit codes, Q8_0: int8 codes, one scale per group of 32) as they are and, per call:
//   - up to 8 rows of x (a small decode batch): expands each weight row's groups in registers and dots them
//     with every row of x, one pass over the codes (faster than fp32's pass over 32-bit weights);
//   - more rows: each thread expands a tile of 128 weight rows to float32 in a buffer of its own (L2-sized)
//     and multiplies x by it in one single-threaded GEMM (at::mm_out), so only a tile at a time is float32.
// Measured (2 cores, AVX2, SmolLM2's four linear shapes of a layer, ms, oneDNN fp32 -> this): 1 row 0.56 ->
// 0.38, 8 rows 0.88 -> 0.99, 16 rows 1.33 -> 1.81, 64 rows 3.5-4.9 -> 4.2-5.0.
//
// y [M, N] = x [M, K] @ W.T with W given per group of 32 inputs by a block format:
//   Q4: codes [N, K / 2] uint8 in GGUF's Q4 block layout (byte j of a group's 16 holds element j in its low
//       nibble and element j + 16 in its high nibble), W = d * q + m (Q4_1; Q4_0 is m = -8 d);
//   Q8: codes [N, K] int8, W = d * q (Q8_0).
// d (and m) [N, K / 32] float32.

#include "cpu_kernels.h"

struct Q4Format {
  static constexpr int64_t kGroupBytes = 16;
#if defined(__AVX2__) && defined(__FMA__)
  static inline void group(const uint8_t* qs, float d, float m, __m256 w[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), dv, mv);
  }
#endif
  static inline void group_scalar(const uint8_t* qs, float d, float m, float* out) {
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
};

struct Q8Format {
  static constexpr int64_t kGroupBytes = 32;
#if defined(__AVX2__) && defined(__FMA__)
  static inline void group(const uint8_t* qs, float d, float, __m256 w[4]) {
    const __m256 dv = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), dv);
    }
  }
#endif
  static inline void group_scalar(const uint8_t* qs, float d, float, float* out) {
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(qs[j]));
  }
};

#if defined(__AVX2__) && defined(__FMA__)
static inline float gguf_hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// One weight row (K / 32 groups) expanded to float32. m is null for formats without a minimum.
template <typename F>
static inline void expand_row(const uint8_t* q, const float* d, const float* m, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float mg = m ? m[g] : 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 w[4];
    F::group(q + g * F::kGroupBytes, d[g], mg, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + g * 32 + 8 * i, w[i]);
#else
    F::group_scalar(q + g * F::kGroupBytes, d[g], mg, out + g * 32);
#endif
  }
}

// R <= 8 rows of x (a small decode batch): each weight row is expanded once, in registers, and dotted with
// every row of x; one pass over the codes and no GEMM call.
template <typename F, int R>
static void dot_rows(const float* x, int64_t ldx, const uint8_t* cp, const float* dp, const float* mp,
                     int64_t N, int64_t K, float* y) {
  const int64_t row_bytes = K / 32 * F::kGroupBytes, groups = K / 32;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* q = cp + n * row_bytes;
      const float* d = dp + n * groups;
      const float* m = mp ? mp + n * groups : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m256 w[4];
        F::group(q + g * F::kGroupBytes, d[g], m ? m[g] : 0.f, w);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * ldx + g * 32;
          for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) y[r * N + n] = gguf_hsum(acc[r]);
#else
      float acc[R] = {}, w[32];
      for (int64_t g = 0; g < groups; ++g) {
        F::group_scalar(q + g * F::kGroupBytes, d[g], m ? m[g] : 0.f, w);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 32; ++j) acc[r] += w[j] * x[r * ldx + g * 32 + j];
      }
      for (int r = 0; r < R; ++r) y[r * N + n] = acc[r];
#endif
    }
  });
}

template <typename F>
static torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                                  const float* mp, int64_t tile_rows) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* dp = d.data_ptr<float>();
  if (M <= 8) {
    using DotRows = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t,
                             int64_t, float*);
    static const DotRows kernels[9] = {nullptr,          dot_rows<F, 1>, dot_rows<F, 2>,
                                       dot_rows<F, 3>,   dot_rows<F, 4>, dot_rows<F, 5>,
                                       dot_rows<F, 6>,   dot_rows<F, 7>, dot_rows<F, 8>};
    if (M > 0) kernels[M](x.data_ptr<float>(), x.stride(0), cp, dp, mp, N, K, y.data_ptr<float>());
    return y;
  }
  // Each thread expands its tiles of weight rows into a float32 buffer of its own and runs one GEMM per
  // tile. Inside at::parallel_for (an OpenMP region) the GEMM runs on the calling thread: OpenMP does not
  // nest by default and torch's BLAS calls follow it, so the two threads do not fork again (measured:
  // 2 threads x 1, no oversubscription).
  const int64_t tiles = (N + tile_rows - 1) / tile_rows, row_bytes = K / 32 * F::kGroupBytes;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the pool's threads need it too
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    auto tile = at::empty({tile_rows, K}, x.options());
    float* tp = tile.data_ptr<float>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows, rows = std::min(tile_rows, N - n0);
      for (int64_t r = 0; r < rows; ++r)
        expand_row<F>(cp + (n0 + r) * row_bytes, dp + (n0 + r) * (K / 32),
                      mp ? mp + (n0 + r) * (K / 32) : nullptr, K, tp + r * K);
      auto out = y.narrow(1, n0, rows);
      at::mm_out(out, x, tile.narrow(0, 0, rows).t());
    }
  });
  return y;
}

static void check_block_args(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                             int64_t code_columns, int64_t tile_rows) {
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == code_columns,
              "codes: contiguous [N, K / 2] (Q4) or [N, K] (Q8), K a multiple of 32");
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kFloat && d.numel() == N * (K / 32),
              "d: float32 [N, K / 32]");
  TORCH_CHECK(tile_rows > 0, "tile_rows > 0");
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                        int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: float32 [M, K]");
  check_block_args(x, codes, d, x.size(1) / 2, tile_rows);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "Q4 codes: uint8");
  TORCH_CHECK(m.is_contiguous() && m.scalar_type() == at::kFloat && m.numel() == d.numel(), "m like d");
  return block_linear<Q4Format>(x, codes, d, m.data_ptr<float>(), tile_rows);
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: float32 [M, K]");
  check_block_args(x, codes, d, x.size(1), tile_rows);
  TORCH_CHECK(codes.scalar_type() == at::kChar, "Q8 codes: int8");
  return block_linear<Q8Format>(x, codes, d, nullptr, tile_rows);
}
