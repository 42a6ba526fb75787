"""C++ source of the GGUF 4-bit linear (quantization="gguf"), built into cpu_attention's extension.

Why our own: torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu, whose group format would fit) ran a
decoder layer's four linears 10x (1 row) to 60x (64 rows) slower than oneDNN fp32 on the AVX2 bench
machine (torch 2.13; its fast path is AVX-512). This one keeps the GGUF blocks as they are and, per call:
  - up to 8 rows of x (a small decode batch): expands each weight row's groups in registers and dots them
    with every row of x, one pass over the 4.5-bit codes (faster than fp32's pass over 32-bit weights);
  - more rows: each thread expands a tile of 128 weight rows to float32 in a buffer of its own (L2-sized)
    and multiplies x by it in one single-threaded GEMM (at::mm_out), so only a tile at a time is float32.
Measured (2 cores, AVX2, SmolLM2's four linear shapes of a layer, ms, oneDNN fp32 -> this): 1 row 0.56 ->
0.38, 8 rows 0.88 -> 0.99, 16 rows 1.33 -> 1.81, 64 rows 3.5-4.9 -> 4.2-5.0.
"""

GGUF_FUNCTIONS = ["q4_linear"]

GGUF_SOURCE = r"""
// y [M, N] = x [M, K] @ W.T, W = d * q + m per group of 32 inputs (GGUF Q4_1; Q4_0 is m = -8 d).
// codes [N, K / 2] uint8 in GGUF's block layout: byte j of a group's 16 holds element j (low nibble) and
// element j + 16 (high nibble); d, m [N, K / 32] float32.
#if defined(__AVX2__) && defined(__FMA__)
// One group's 32 weights, d * q + m, as four vectors (elements 0-7, 8-15, 16-23, 24-31).
static inline void q4_group(const uint8_t* qs, float d, float m, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), dv, mv);
}

static inline float q4_hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// One weight row (K / 32 groups) expanded to float32.
static inline void q4_expand_row(const uint8_t* q, const float* d, const float* m, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 w[4];
    q4_group(q + g * 16, d[g], m[g], w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + g * 32 + 8 * i, w[i]);
#else
    for (int j = 0; j < 16; ++j) {
      out[g * 32 + j] = d[g] * static_cast<float>(q[g * 16 + j] & 0x0F) + m[g];
      out[g * 32 + j + 16] = d[g] * static_cast<float>(q[g * 16 + j] >> 4) + m[g];
    }
#endif
  }
}

// R <= 8 rows of x (a small decode batch): each weight row is expanded once, in registers, and dotted with
// every row of x; one pass over the 4.5-bit codes and no GEMM call.
template <int R>
static void q4_dot_rows(const float* x, int64_t ldx, const uint8_t* cp, const float* dp, const float* mp,
                        int64_t N, int64_t K, float* y) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* q = cp + n * (K / 2);
      const float* d = dp + n * (K / 32);
      const float* m = mp + n * (K / 32);
#if defined(__AVX2__) && defined(__FMA__)
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < K / 32; ++g) {
        __m256 w[4];
        q4_group(q + g * 16, d[g], m[g], w);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * ldx + g * 32;
          for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) y[r * N + n] = q4_hsum(acc[r]);
#else
      float acc[R] = {}, row[32];
      for (int64_t g = 0; g < K / 32; ++g) {
        q4_expand_row(q + g * 16, d + g, m + g, 32, row);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 32; ++j) acc[r] += row[j] * x[r * ldx + g * 32 + j];
      }
      for (int r = 0; r < R; ++r) y[r * N + n] = acc[r];
#endif
    }
  });
}

using Q4DotRows = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t,
                           int64_t, float*);
static const Q4DotRows kQ4DotRows[9] = {nullptr,          q4_dot_rows<1>, q4_dot_rows<2>,
                                        q4_dot_rows<3>,   q4_dot_rows<4>, q4_dot_rows<5>,
                                        q4_dot_rows<6>,   q4_dot_rows<7>, q4_dot_rows<8>};

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                        int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
              codes.size(1) == K / 2, "codes: uint8 [N, K / 2], K a multiple of 32");
  TORCH_CHECK(d.is_contiguous() && m.is_contiguous() && d.scalar_type() == at::kFloat &&
              m.scalar_type() == at::kFloat && d.numel() == N * (K / 32) && m.numel() == d.numel(),
              "d, m: float32 [N, K / 32]");
  TORCH_CHECK(tile_rows > 0, "tile_rows > 0");
  auto y = at::empty({M, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  if (M <= 8) {
    if (M > 0) kQ4DotRows[M](x.data_ptr<float>(), x.stride(0), cp, dp, mp, N, K, y.data_ptr<float>());
    return y;
  }
  // Each thread expands its tiles of weight rows into a float32 buffer of its own and runs one
  // single-threaded GEMM per tile (inside parallel_for torch's GEMMs do not fork again).
  const int64_t tiles = (N + tile_rows - 1) / tile_rows;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the pool's threads need it too
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    auto tile = at::empty({tile_rows, K}, x.options());
    float* tp = tile.data_ptr<float>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows, rows = std::min(tile_rows, N - n0);
      for (int64_t r = 0; r < rows; ++r)
        q4_expand_row(cp + (n0 + r) * (K / 2), dp + (n0 + r) * (K / 32), mp + (n0 + r) * (K / 32), K,
                      tp + r * K);
      auto out = y.narrow(1, n0, rows);
      at::mm_out(out, x, tile.narrow(0, 0, rows).t());
    }
  });
  return y;
}
"""
