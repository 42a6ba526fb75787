// Fused CPU elementwise ops of a decoder layer (rotary, SiLU-and-mul, add + RMSNorm, K/V store plain or
// quantized to int8 / uint8 codes, int8's per-token row scaling).
//
// Why: rotary is 14 small torch ops per layer, SiLU-and-mul 3, add + RMSNorm 9, the K/V store 2-4
// (index_select, index_copy_) and int8's per-token row scaling 4, each a dispatch plus a pass over memory;
// these kernels do each in one pass (fp32, 32-1024 rows: rotary 79 -> 5 us, SiLU-and-mul 97 -> 14 us at 32
// rows). Values are float32 inside, rounded to the tensor's dtype where transformers rounds
// (silu(gate) before the product; the residual sum, and the normalized row before the weight), so fp32 stays
// within float rounding of transformers. The RMSNorm's elementwise part is compiled without -ffast-math so
// that w * (x * (1 / sqrt(var + eps))) keeps transformers' order and exact IEEE division; only the sum of
// squares is reassociated (torch's own vectorized sum orders it differently again).

#include "cpu_kernels.h"

// Rotate (NeoX "rotate half") the first `heads` heads of each row of qkv [T, >= heads * D] in place:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin [T, D / 2] in qkv's dtype.
template <typename T>
static void rotary_impl(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t rows, int64_t heads,
                        int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
          x[i] = T(x1 * ci - x2 * si);
          x[i + half] = T(x2 * ci + x1 * si);
        }
      }
    }
  });
}

void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim, "qkv [T, >= heads*D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * (head_dim / 2) &&
              sin.numel() == cos.numel(), "cos/sin [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "one dtype");
  if (qkv.scalar_type() == at::kFloat)
    rotary_impl<float>(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       qkv.size(0), heads, head_dim);
  else if (qkv.scalar_type() == at::kBFloat16)
    rotary_impl<bf16>(qkv.data_ptr<bf16>(), qkv.stride(0), cos.data_ptr<bf16>(), sin.data_ptr<bf16>(),
                      qkv.size(0), heads, head_dim);
  else
    TORCH_CHECK(false, "float32 or bfloat16");
}

template <typename T>
static void silu_mul_impl(const T* x, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = T(g / (1.f + std::exp(-g)));  // silu(gate) in the model dtype, as F.silu returns it
        o[i] = T(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

// x [T, 2I] (gate | up) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "contiguous [T, 2I]");
  const int64_t width = x.size(1) / 2;
  auto out = torch::empty({x.size(0), width}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_impl<float>(x.data_ptr<float>(), out.data_ptr<float>(), x.size(0), width);
  else if (x.scalar_type() == at::kBFloat16)
    silu_mul_impl<bf16>(x.data_ptr<bf16>(), out.data_ptr<bf16>(), x.size(0), width);
  else
    TORCH_CHECK(false, "float32 or bfloat16");
  return out;
}

// Element access in float32 for a float or bf16 array (a bf16 is the high half of a float32: widening is
// exact; narrowing rounds to nearest even like torch's .to(bfloat16), a NaN stays NaN). Macros, not
// functions: the exact-arithmetic functions below are compiled without -ffast-math, and GCC does not inline
// functions compiled with other options into them (a call per element would be 10x slower).
#define IS_F32(T) std::is_same_v<T, float>
#define F32_BITS(f) __builtin_bit_cast(uint32_t, (f))
#define BF16_BITS(f) ((F32_BITS(f) + 0x7fffu + ((F32_BITS(f) >> 16) & 1u)) >> 16)
#define LOAD_F32(T, p, i) \
  (IS_F32(T) ? reinterpret_cast<const float*>(p)[i] \
             : __builtin_bit_cast(float, uint32_t(reinterpret_cast<const uint16_t*>(p)[i]) << 16))
#define STORE_AS(T, p, i, f)                                                                     \
  do {                                                                                           \
    const float f_ = (f);                                                                        \
    if constexpr (IS_F32(T)) reinterpret_cast<float*>(p)[i] = f_;                               \
    else reinterpret_cast<uint16_t*>(p)[i] = uint16_t(f_ != f_ ? 0x7fc0u : BF16_BITS(f_));      \
  } while (0)
#define ROUND_AS(T, f) \
  (IS_F32(T) ? (f) : ((f) != (f) ? (f) : __builtin_bit_cast(float, uint32_t(BF16_BITS(f)) << 16)))

// One row: sum = T(x + residual) when there is a residual; y = T(w * T(s * (1 / sqrt(mean(s^2) + eps))))
// in exact IEEE arithmetic, transformers' order (no fast-math). The sum of squares runs in 8 lanes (other
// than torch's order, which differs again; the difference is float rounding).
template <typename T>
__attribute__((optimize("no-fast-math"))) static void rms_norm_row(const T* x, const T* res, T* sum,
                                                                    const T* w, T* y, int64_t H, float eps) {
  const T* row = x;
  if (res != nullptr) {
    for (int64_t i = 0; i < H; ++i) STORE_AS(T, sum, i, LOAD_F32(T, x, i) + LOAD_F32(T, res, i));
    row = sum;
  }
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    for (int k = 0; k < 8; ++k) {
      const float v = LOAD_F32(T, row, i + k);
      lanes[k] += v * v;
    }
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < H; ++i) {
    const float v = LOAD_F32(T, row, i);
    total += v * v;
  }
  const float inv = 1.f / std::sqrt(total / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) {
    const float normed = LOAD_F32(T, row, j) * inv;
    STORE_AS(T, y, j, LOAD_F32(T, w, j) * ROUND_AS(T, normed));
  }
}

template <typename T>
static void rms_norm_impl(const T* x, const T* residual, T* sum, const T* w, T* y, int64_t rows, int64_t H,
                          float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row<T>(x + r * H, residual == nullptr ? nullptr : residual + r * H,
                      residual == nullptr ? nullptr : sum + r * H, w, y + r * H, H, eps);
  });
}

// RMSNorm of x [T, H] (or of x + residual, returned too as the next residual): [y] or [y, x + residual].
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && weight.is_contiguous() && weight.numel() == x.size(1),
              "contiguous x [T, H] and weight [H]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight of one dtype");
  const bool add = residual.has_value();
  if (add)
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "residual like x");
  auto y = torch::empty_like(x);
  auto sum = add ? torch::empty_like(x) : x;
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(x.data_ptr<float>(), add ? residual->data_ptr<float>() : nullptr,
                         sum.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0),
                         x.size(1), static_cast<float>(eps));
  else if (x.scalar_type() == at::kBFloat16)
    rms_norm_impl<bf16>(x.data_ptr<bf16>(), add ? residual->data_ptr<bf16>() : nullptr, sum.data_ptr<bf16>(),
                        weight.data_ptr<bf16>(), y.data_ptr<bf16>(), x.size(0), x.size(1),
                        static_cast<float>(eps));
  else
    TORCH_CHECK(false, "float32 or bfloat16");
  if (add) return {y, sum};
  return {y};
}

// Write row rows[i] (i when rows is absent) of k and v [T, Hkv, D] into cache slot slots[i] of k_cache and
// v_cache [blocks, block_size, Hkv, D]: index_select + index_copy_ in one pass, reading k/v in place (they
// are strided views of the qkv projection).
// A K/V store's slots (and rows of k / v, or None: one slot per token), checked before any write so that a
// bad slot leaves the cache untouched; returns the rows' pointer (nullptr: token i goes to slot i).
static const int64_t* checked_store_rows(const torch::Tensor& slots, const c10::optional<torch::Tensor>& rows,
                                         int64_t tokens, int64_t capacity) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "int64 slots");
  const int64_t n = slots.numel();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == n,
                "int64 rows");
    row = rows->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(n == tokens, "one slot per token");
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "slot out of the cache");
    TORCH_CHECK(row == nullptr || (row[i] >= 0 && row[i] < tokens), "row out of k");
  }
  return row;
}

void store_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
               torch::Tensor slots, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k, v [T, Hkv, D], rows of Hkv * D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.size(2) * k_cache.size(3) == k.size(1) * k.size(2) &&
              v_cache.sizes() == k_cache.sizes(),
              "caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
              v_cache.scalar_type() == k.scalar_type(), "k, v and the caches of one dtype");
  const int64_t* row = checked_store_rows(slots, rows, k.size(0), k_cache.size(0) * k_cache.size(1));
  const int64_t n = slots.numel(), width = k.size(1) * k.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = width * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = row == nullptr ? i : row[i];
    std::memcpy(kc + slot[i] * bytes, kp + r * ks, bytes);
    std::memcpy(vc + slot[i] * bytes, vp + r * vs, bytes);
  }
}

// One (token, kv head) row of D values quantized as kv_quant.py's quantize does, in the same float32
// arithmetic (exact IEEE division, round half to even), so the codes and params are bit-identical:
// int8: scale = max(max |x| / 127, 1e-8), code = round(x / scale) in [-127, 127], params [scale];
// uint8: scale = max((max - min) / 255, 1e-8), code = round((x - min) / scale) in [0, 255], params [scale, min].
// A NaN in the row makes the params NaN, as torch's amax / amin do (the row reads back as NaN); a code
// that is NaN (that row, or inf / inf) is stored as 0, where a float -> int cast would be undefined.
template <typename T, typename Code>
__attribute__((optimize("no-fast-math"))) static void quantize_kv_row(const T* x, int64_t D, Code* codes,
                                                                      float* params) {
  constexpr bool kSigned = std::is_same_v<Code, int8_t>;
  float low = LOAD_F32(T, x, 0), high = low;
  for (int64_t i = 1; i < D; ++i) {  // builtins and ternaries only: no calls in a no-fast-math function
    const float a = LOAD_F32(T, x, i);
    low = (a < low || a != a) ? a : low;  // a NaN, once taken, stays: every comparison with it is false
    high = (a > high || a != a) ? a : high;
  }
  if constexpr (kSigned) {
    const float a = __builtin_fabsf(low), b = __builtin_fabsf(high);
    const float peak = a > b ? a : b;
    const float q = peak / 127.0f;
    const float scale = q < 1e-8f ? 1e-8f : q;
    for (int64_t i = 0; i < D; ++i) {
      const float c = __builtin_rintf(LOAD_F32(T, x, i) / scale);
      codes[i] = static_cast<Code>(c != c ? 0.0f : (c < -127.0f ? -127.0f : (c > 127.0f ? 127.0f : c)));
    }
    params[0] = scale;
  } else {
    const float q = (high - low) / 255.0f;
    const float scale = q < 1e-8f ? 1e-8f : q;
    for (int64_t i = 0; i < D; ++i) {
      const float c = __builtin_rintf((LOAD_F32(T, x, i) - low) / scale);
      codes[i] = static_cast<Code>(c != c ? 0.0f : (c < 0.0f ? 0.0f : (c > 255.0f ? 255.0f : c)));
    }
    params[0] = scale;
    params[1] = low;
  }
}

template <typename T, typename Code>
static void store_kv_quantized_impl(const torch::Tensor& x, const torch::Tensor& codes,
                                    const torch::Tensor& params, const int64_t* slot, const int64_t* row,
                                    int64_t n) {
  const int64_t heads = codes.size(2), D = codes.size(3), P = params.size(3);
  const T* src = static_cast<const T*>(x.data_ptr());
  Code* dst = static_cast<Code*>(codes.data_ptr());
  float* prm = params.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = row == nullptr ? i : row[i];
      for (int64_t h = 0; h < heads; ++h)
        quantize_kv_row<T, Code>(src + r * stride + h * D, D, dst + (slot[i] * heads + h) * D,
                                 prm + (slot[i] * heads + h) * P);
    }
  });
}

void store_kv_quantized_(torch::Tensor k, torch::Tensor v, torch::Tensor k_codes, torch::Tensor v_codes,
                         torch::Tensor k_params, torch::Tensor v_params, torch::Tensor slots,
                         c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k, v [T, Hkv, D], rows of Hkv * D");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16), "float32 or bf16 k, v");
  const auto code = k_codes.scalar_type();
  TORCH_CHECK((code == at::kChar || code == at::kByte) && v_codes.scalar_type() == code,
              "int8 or uint8 codes");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_codes.dim() == 4 &&
              v_codes.sizes() == k_codes.sizes() && k_codes.size(2) == k.size(1) &&
              k_codes.size(3) == k.size(2),
              "codes [blocks, block_size, Hkv, D]");
  const int64_t P = code == at::kChar ? 1 : 2;
  TORCH_CHECK(k_params.scalar_type() == at::kFloat && v_params.scalar_type() == at::kFloat &&
              k_params.is_contiguous() && v_params.is_contiguous() && k_params.dim() == 4 &&
              v_params.sizes() == k_params.sizes() && k_params.size(0) == k_codes.size(0) &&
              k_params.size(1) == k_codes.size(1) && k_params.size(2) == k_codes.size(2) &&
              k_params.size(3) == P, "float32 params [blocks, block_size, Hkv, 1 (int8) or 2 (uint8)]");
  const int64_t* row = checked_store_rows(slots, rows, k.size(0), k_codes.size(0) * k_codes.size(1));
  const int64_t n = slots.numel();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const bool f32 = k.scalar_type() == at::kFloat;
  const auto store = [&](const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& params) {
    if (code == at::kChar) {
      if (f32) store_kv_quantized_impl<float, int8_t>(x, codes, params, slot, row, n);
      else store_kv_quantized_impl<bf16, int8_t>(x, codes, params, slot, row, n);
    } else {
      if (f32) store_kv_quantized_impl<float, uint8_t>(x, codes, params, slot, row, n);
      else store_kv_quantized_impl<bf16, uint8_t>(x, codes, params, slot, row, n);
    }
  };
  store(k, k_codes, k_params);
  store(v, v_codes, v_params);
}

// Each row of x [T, K] float32 divided by its max |x| (at least `floor`): [x / m, m [T, 1]] (int8's
// per-token input scaling, exact IEEE division like torch's).
__attribute__((optimize("no-fast-math"))) static void scale_rows_impl(const float* x, float* y, float* m,
                                                                      int64_t rows, int64_t K, float floor) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * K;
      float peak = floor;  // builtins and ternaries only: no calls in a no-fast-math function
      for (int64_t i = 0; i < K; ++i) {
        const float a = __builtin_fabsf(row[i]);
        peak = a > peak ? a : peak;
      }
      m[r] = peak;
      float* out = y + r * K;
      for (int64_t i = 0; i < K; ++i) out[i] = row[i] / peak;
    }
  });
}

std::vector<torch::Tensor> scale_rows(torch::Tensor x, double floor) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == at::kFloat, "float32 [T, K]");
  auto y = torch::empty_like(x);
  auto m = torch::empty({x.size(0), 1}, x.options());
  scale_rows_impl(x.data_ptr<float>(), y.data_ptr<float>(), m.data_ptr<float>(), x.size(0), x.size(1),
                  static_cast<float>(floor));
  return {y, m};
}
