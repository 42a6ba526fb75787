// A float32 model's greedy rows: which tokens can be a row's float32 argmax, screened from a bf16 GEMM of the
// same row, and those tokens' logits recomputed in float32 (engine/layers/greedy_head.py drives it).
//
// Why: a greedy request reads one number of its [vocab] logits, the argmax. The float32 LM head is ~21% of a
// SmolLM2 decode step's FLOPs (49152 x 576 of its 269 MFLOP per token); a bf16 GEMM of the same product runs
// at twice the float32 rate on avx512_bf16 CPUs (more on AMX), and its error has a bound one can compute per
// token. Every token whose bound window reaches the best lower bound of the row is a candidate; the others
// provably lose to that token in float32, so the argmax over the candidates' float32 logits is the row's
// float32 argmax (of this file's dot products, which sum in another order than the full GEMM would).
//
// The bound, for row x (float32) and token v (float32 weight row w_v), approx a_v = bf16 GEMM of bf16(x) and
// bf16(w_v) rounded to bf16, u = 2^-8 (bf16's unit roundoff), g = K u_32 / (1 - K u_32) (float32 sums of K
// terms): |x . w_v - a_v| <= (2u + u^2 + 2g) |x| |w_v| + u / (1 - u) |a_v| (Cauchy-Schwarz over sum |x_k w_vk|;
// the float32 recomputation's own error is the second g), plus f (sqrt(K) (|x| + |w_v|) + 2K + 2) with
// f = 2^-126 for the denormals bf16 dot-product hardware flushes (inputs, products, partial sums). greedy_head.py
// passes every factor doubled, which also covers the bound's own arithmetic and a GEMM that rounds its sums
// less carefully. A row whose bound is not finite (inf / nan activations, an overflowing approximation) gets
// every logit in float32, as the full GEMM would give it.
//
// -ffast-math (the build's flags) lets the compiler assume finite values, so finiteness is read from bits, and
// -inf is written as its bit pattern.

#include "cpu_kernels.h"

namespace {

constexpr uint32_t kNegInfBits = 0xff800000u;

inline float neg_inf() {
  float f;
  std::memcpy(&f, &kNegInfBits, sizeof f);
  return f;
}

inline bool is_finite(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return (bits & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

inline bool is_finite(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// x . w over K float32 values, one fixed order (so a token's logit is the same whatever else is screened).
inline float dot_row(const float* x, const float* w, int64_t K) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
  }
  for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * w[k];
  return s;
#endif
}

template <typename A>
inline float approx_at(const A* a, int64_t v) {
  return static_cast<float>(a[v]);
}

#if defined(__AVX512F__)
inline __m512 load_approx16(const bf16* a) {  // bf16 -> float32: the bits shifted into the high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load_approx16(const float* a) { return _mm512_loadu_ps(a); }
#endif

inline int64_t every_logit(float* out, const float* x, const float* w, int64_t V, int64_t K) {
  for (int64_t v = 0; v < V; ++v) out[v] = dot_row(x, w + v * K, K);
  return V;
}

// One row: out[v] = x . w_v for the candidates, -inf elsewhere; returns how many candidates. The slack of
// token v: scale |w_v| + out_rel |a_v| + floor (scale and floor per row, from the row's norm).
template <typename A>
int64_t screen_row(float* out, const A* a, const float* x, const float* w, const float* norms, int64_t V,
                   int64_t K, float rel, float out_rel, float denormal) {
  double sq = 0.0;
  for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(x[k]) * x[k];
  const double nx = std::sqrt(sq), root_k = std::sqrt(static_cast<double>(K));
  const float scale = static_cast<float>(nx * rel + denormal * root_k);
  const float floor = static_cast<float>(denormal * (root_k * nx + 2.0 * K + 2.0));
  if (!is_finite(nx) || !is_finite(scale) || !is_finite(floor)) return every_logit(out, x, w, V, K);
  float lower = std::numeric_limits<float>::lowest();  // the best lower bound of the row
  int64_t v = 0;
#if defined(__AVX512F__)
  const __m512 vscale = _mm512_set1_ps(scale), vout = _mm512_set1_ps(out_rel), vfloor = _mm512_set1_ps(floor);
  __m512 vlower = _mm512_set1_ps(lower);
  for (; v + 16 <= V; v += 16) {
    const __m512 av = load_approx16(a + v);
    const __m512 slack = _mm512_fmadd_ps(vscale, _mm512_loadu_ps(norms + v),
                                         _mm512_fmadd_ps(vout, _mm512_abs_ps(av), vfloor));
    vlower = _mm512_max_ps(vlower, _mm512_sub_ps(av, slack));
  }
  lower = _mm512_reduce_max_ps(vlower);
#endif
  for (int64_t t = v; t < V; ++t) {
    const float av = approx_at(a, t);
    lower = std::max(lower, av - (scale * norms[t] + out_rel * std::fabs(av) + floor));
  }
  // an approximation that overflowed (or a nan from one): no bound holds
  if (!is_finite(lower)) return every_logit(out, x, w, V, K);
  int64_t found = 0;
  const float ninf = neg_inf();
  v = 0;
#if defined(__AVX512F__)
  vlower = _mm512_set1_ps(lower);
  const __m512 vninf = _mm512_set1_ps(ninf);
  for (; v + 16 <= V; v += 16) {
    const __m512 av = load_approx16(a + v);
    const __m512 slack = _mm512_fmadd_ps(vscale, _mm512_loadu_ps(norms + v),
                                         _mm512_fmadd_ps(vout, _mm512_abs_ps(av), vfloor));
    uint32_t hits = _mm512_cmp_ps_mask(_mm512_add_ps(av, slack), vlower, _CMP_GE_OQ);
    _mm512_storeu_ps(out + v, vninf);
    for (; hits != 0; hits &= hits - 1) {
      const int64_t t = v + __builtin_ctz(hits);
      out[t] = dot_row(x, w + t * K, K);
      ++found;
    }
  }
#endif
  for (; v < V; ++v) {
    const float av = approx_at(a, v);
    if (av + (scale * norms[v] + out_rel * std::fabs(av) + floor) >= lower) {
      out[v] = dot_row(x, w + v * K, K);
      ++found;
    } else {
      out[v] = ninf;
    }
  }
  return found;
}

template <typename A>
int64_t screen_impl(torch::Tensor& out, const torch::Tensor& approx, const torch::Tensor& x,
                    const torch::Tensor& weight, const torch::Tensor& norms, const torch::Tensor& rows, float rel,
                    float out_rel, float denormal) {
  const int64_t R = x.size(0), K = x.size(1), V = weight.size(0);
  const A* ap = approx.data_ptr<A>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t a_s = approx.stride(0), o_s = out.stride(0);
  std::vector<int64_t> found(R, 0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      found[r] = screen_row(op + rp[r] * o_s, ap + r * a_s, xp + r * K, wp, np, V, K, rel, out_rel, denormal);
  });
  int64_t total = 0;
  for (int64_t n : found) total += n;
  return total;
}

}  // namespace

int64_t screen_argmax_logits(torch::Tensor out, torch::Tensor approx, torch::Tensor x, torch::Tensor weight,
                             torch::Tensor weight_norms, torch::Tensor rows, double rel_slack,
                             double out_slack, double denormal_slack) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: a contiguous float32 [R, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "weight: a contiguous float32 [V, K] with x's K");
  const int64_t R = x.size(0), V = weight.size(0);
  TORCH_CHECK(weight_norms.scalar_type() == at::kFloat && weight_norms.is_contiguous() &&
                  weight_norms.numel() == V,
              "weight_norms: float32 [V]");
  TORCH_CHECK(approx.dim() == 2 && approx.size(0) == R && approx.size(1) >= V && approx.stride(1) == 1 &&
                  (approx.scalar_type() == at::kBFloat16 || approx.scalar_type() == at::kFloat),
              "approx: bf16 or float32 [R, >= V], rows contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == R,
              "rows: int64 [R], the out row of each x row");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(1) == V && out.stride(1) == 1,
              "out: float32 [M, V], rows contiguous");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < out.size(0), "rows: out of range");
  const float rel = static_cast<float>(rel_slack), out_rel = static_cast<float>(out_slack);
  const float denormal = static_cast<float>(denormal_slack);
  if (approx.scalar_type() == at::kBFloat16)
    return screen_impl<bf16>(out, approx, x, weight, weight_norms, rows, rel, out_rel, denormal);
  return screen_impl<float>(out, approx, x, weight, weight_norms, rows, rel, out_rel, denormal);
}
