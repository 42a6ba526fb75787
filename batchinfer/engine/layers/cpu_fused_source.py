"""C++ source of fused CPU elementwise ops of a decoder layer, built into cpu_attention's extension.

Why: rotary is 14 small torch ops per layer and SiLU-and-mul 3, each a dispatch plus a pass over memory;
these kernels do each in one pass (fp32, 32-1024 rows: rotary 79 -> 5 us, SiLU-and-mul 97 -> 14 us at 32
rows). Values are float32 inside, rounded to the tensor's dtype where transformers rounds (silu(gate)
before the product), so fp32 stays within float rounding of transformers. A fused add + RMSNorm was tried
and dropped: scalar bf16 conversions made it no faster than torch's vectorized ops.
"""

FUSED_FUNCTIONS = ["rotary_", "silu_and_mul"]

FUSED_SOURCE = r"""
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
"""
