// The Llama decoder stack of one step in one native call (engine/worker/native_step.py drives it).
//
// Why: the Python layer loop dispatches ~18 ops per layer (norms, the four linears, rotary, the K/V store,
// attention, SiLU-and-mul, views) through nn.Module calls; on 2 cores that interpreter time between the
// kernels is 10-40% of a small decode step (int8, whose GEMMs are fastest, loses most). This loop calls the
// same kernels in the same order (fused_ops.cpp, paged_attention.cpp, panel_gemm.cpp, oneDNN's prepacked GEMM
// or the dynamic int8 GEMM (fbgemm's, oneDNN's on AMX) through the dispatcher), so its output is bit-identical to the Python path.
//
// A quantized cache (int8 / u8 codes) is stored and read by the same kernels the Python path calls
// (store_kv_quantized_, paged_decode_attention_quantized). A step that is not decode-only (prefill chunks,
// whose attention runs as padded SDPA groups) or whose KV cache the native kernel cannot read passes
// `attention`, a Python callable (layer, q, k, v) -> [T, H * D]:
// only attention then runs in Python, once per layer.

#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include "cpu_kernels.h"

namespace {

constexpr double kTinyRowMax = 1e-12;  // weight_packing.TINY_ROW_MAX: an all-zero row stays all zero

// How a linear's weight is packed (weight_packing.py's kernels; the values are NativeLinearKind there).
enum LinearKind : int64_t {
  kAtenLinear = 0, kOneDnnLinear = 1, kInt8Linear = 2, kPanelLinear = 3, kAmxLinear = 4, kAmxBlockLinear = 5
};

struct NativeLinear {
  int64_t kind = kAtenLinear;
  torch::Tensor weight;                // aten: the dense [N, K] weight; oneDNN: the prepacked weight (float32
                                       // under bf16 activations where oneDNN has no bf16 GEMM); panel: the
                                       // [P, K, 16] panels of pack_panels; amx: pack_amx_weight's halves;
                                       // amx blocks: pack_amx_blocks' codes
  torch::Tensor scales;                // amx blocks: pack_amx_blocks' scales (d, m per group)
  int64_t out_features = 0;            // panel / amx / amx blocks: N (the last panel or tile may be padded)
  c10::optional<torch::Tensor> bias;   // aten / oneDNN: in the GEMM; int8 per token: added after rescaling
  c10::IValue packed;                  // int8: fbgemm's / oneDNN's LinearPackedParamsBase (bias inside, per
                                       // tensor)
  bool per_token = false;              // int8: each row scaled to max 1 around the GEMM
  bool reduce_range = false;           // int8: 7-bit activations (no VNNI)
};

torch::Tensor run_linear(const NativeLinear& l, const torch::Tensor& x) {
  if (l.kind == kPanelLinear) return panel_linear(x, l.weight, l.bias, l.out_features);
  if (l.kind == kAmxLinear) return amx_linear(x, l.weight, l.bias, l.out_features);
  if (l.kind == kAmxBlockLinear) return amx_block_linear(x, l.weight, l.scales, l.bias, l.out_features);
  if (l.kind == kOneDnnLinear) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    // A float32 weight under bf16 activations: bf16 where oneDNN has no bf16 GEMM (weight_packing's
    // OneDnnLinear compute_dtype): widen x, run the fp32 GEMM, round the output back.
    const bool widen = x.scalar_type() != l.weight.scalar_type();
    torch::jit::Stack stack{widen ? x.to(l.weight.scalar_type()) : x, l.weight,
                            l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue(),
                            c10::IValue(std::string("none")),
                            c10::IValue(c10::List<c10::optional<at::Scalar>>()),
                            c10::IValue(std::string(""))};
    op.callBoxed(&stack);
    return widen ? stack[0].toTensor().to(x.scalar_type()) : stack[0].toTensor();
  }
  if (l.kind == kInt8Linear) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
    torch::Tensor flat = x.to(at::kFloat);
    torch::Tensor row_max;
    if (l.per_token) {
      auto scaled = scale_rows(flat.contiguous(), kTinyRowMax);
      flat = scaled[0];
      row_max = scaled[1];
    }
    torch::jit::Stack stack{flat, l.packed, l.reduce_range};
    op.callBoxed(&stack);
    torch::Tensor out = stack[0].toTensor();
    if (l.per_token) {
      out.mul_(row_max);
      if (l.bias.has_value()) out.add_(*l.bias);
    }
    return out.to(x.scalar_type());
  }
  return at::linear(x, l.weight, l.bias);
}

NativeLinear make_linear(int64_t kind, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                         py::object packed, bool per_token, bool reduce_range, int64_t out_features) {
  TORCH_CHECK(kind == kAtenLinear || kind == kOneDnnLinear || kind == kInt8Linear || kind == kPanelLinear ||
                  kind == kAmxLinear || kind == kAmxBlockLinear,
              "unknown linear kind");
  NativeLinear l;
  l.kind = kind;
  l.out_features = out_features;
  l.weight = std::move(weight);
  l.bias = std::move(bias);
  if (kind == kInt8Linear) {
    static const c10::TypePtr packed_type =
        torch::getCustomClass("__torch__.torch.classes.quantized.LinearPackedParamsBase");
    TORCH_CHECK(packed_type != nullptr, "torch's quantized LinearPackedParamsBase is not registered");
    l.packed = torch::jit::toIValue(packed, packed_type);
  }
  if (kind == kAmxBlockLinear) l.scales = packed.cast<torch::Tensor>();
  l.per_token = per_token;
  l.reduce_range = reduce_range;
  return l;
}

struct DecoderLayer {
  torch::Tensor input_norm, post_attention_norm;
  NativeLinear qkv, o_proj, gate_up, down;
  torch::Tensor k_cache, v_cache;    // the model dtype, or int8 / uint8 codes when k_params is defined
  torch::Tensor k_params, v_params;  // a quantized cache's float32 params [NB, BS, Hkv, P]; else undefined
};

}  // namespace

// The layers of one model (weights bound once at load, caches whenever the runner allocates them).
class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
               torch::Tensor final_norm)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        final_norm_(std::move(final_norm)) {}

  // Linears as (kind, weight, bias, packed, per_token, reduce_range, out_features) tuples: qkv, o, gate_up,
  // down.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                 std::vector<py::tuple> linears) {
    TORCH_CHECK(linears.size() == 4, "four linears: qkv, o_proj, gate_up, down");
    std::vector<NativeLinear> made;
    for (const auto& t : linears)
      made.push_back(make_linear(t[0].cast<int64_t>(), t[1].cast<torch::Tensor>(),
                                 t[2].cast<c10::optional<torch::Tensor>>(), t[3].cast<py::object>(),
                                 t[4].cast<bool>(), t[5].cast<bool>(), t[6].cast<int64_t>()));
    layers_.push_back(DecoderLayer{std::move(input_norm), std::move(post_attention_norm), made[0], made[1],
                                   made[2], made[3], torch::Tensor(), torch::Tensor(), torch::Tensor(),
                                   torch::Tensor()});
  }

  void bind_caches(std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one cache per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      layers_[i].k_cache = k_caches[i];
      layers_[i].v_cache = v_caches[i];
      layers_[i].k_params = layers_[i].v_params = torch::Tensor();
    }
  }

  // A quantized cache (kv_quant.py's int8 / u8): per layer, the codes and their float32 params.
  void bind_quantized_caches(std::vector<torch::Tensor> k_codes, std::vector<torch::Tensor> v_codes,
                             std::vector<torch::Tensor> k_params, std::vector<torch::Tensor> v_params) {
    TORCH_CHECK(k_params.size() == layers_.size() && v_params.size() == layers_.size(),
                "one params tensor per layer");
    bind_caches(std::move(k_codes), std::move(v_codes));
    for (size_t i = 0; i < layers_.size(); ++i) {
      layers_[i].k_params = k_params[i];
      layers_[i].v_params = v_params[i];
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [T, hidden] (the embeddings) -> the final norm's output [T, hidden]. cos / sin [T, D / 2] in the
  // model dtype. Decode-only steps (attention None) store K/V at slots (rows: the packed rows written, None:
  // all) and attend through block_tables / seq_lens, without the GIL (other Python threads of the process,
  // a worker's heartbeat, run meanwhile); otherwise attention(layer, q, k, v) does both, under the GIL.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                        c10::optional<torch::Tensor> rows, c10::optional<torch::Tensor> block_tables,
                        c10::optional<torch::Tensor> seq_lens, py::object attention) {
    if (!attention.is_none())
      return run(std::move(hidden), cos, sin, slots, rows, block_tables, seq_lens, &attention);
    TORCH_CHECK(block_tables.has_value() && seq_lens.has_value(),
                "a native-attention step needs block tables and sequence lengths");
    py::gil_scoped_release released;
    return run(std::move(hidden), cos, sin, slots, rows, block_tables, seq_lens, nullptr);
  }

 private:
  torch::Tensor run(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& slots, const c10::optional<torch::Tensor>& rows,
                    const c10::optional<torch::Tensor>& block_tables,
                    const c10::optional<torch::Tensor>& seq_lens, const py::object* attention) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    torch::Tensor h = std::move(hidden);
    c10::optional<torch::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer& layer = layers_[i];
      auto normed = rms_norm(h, residual, layer.input_norm, eps_);
      residual = residual.has_value() ? normed[1] : h;
      torch::Tensor qkv = run_linear(layer.qkv, normed[0]);
      rotary_(qkv, cos, sin, heads_ + kv_heads_, head_dim_);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({-1, heads_, head_dim_});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, kv_heads_, head_dim_});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, kv_heads_, head_dim_});
      torch::Tensor attended;
      if (attention == nullptr) {
        attended = torch::empty_like(q);
        if (layer.k_params.defined()) {
          store_kv_quantized_(k, v, layer.k_cache, layer.v_cache, layer.k_params, layer.v_params, slots, rows);
          paged_decode_attention_quantized(attended, q, layer.k_cache, layer.v_cache, layer.k_params,
                                           layer.v_params, *block_tables, *seq_lens, scale_);
        } else {
          store_kv_(k, v, layer.k_cache, layer.v_cache, slots, rows);
          paged_decode_attention(attended, q, layer.k_cache, layer.v_cache, *block_tables, *seq_lens, scale_);
        }
        attended = attended.reshape({-1, q_size});
      } else {
        attended = (*attention)(static_cast<int64_t>(i), q, k, v).cast<torch::Tensor>();
      }
      torch::Tensor out = run_linear(layer.o_proj, attended);
      auto post = rms_norm(out, residual, layer.post_attention_norm, eps_);
      residual = post[1];
      h = run_linear(layer.down, silu_and_mul(run_linear(layer.gate_up, post[0])));
    }
    return rms_norm(h, residual, final_norm_, eps_)[0];
  }

  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  torch::Tensor final_norm_;
  std::vector<DecoderLayer> layers_;
};

void bind_decoder_stack(py::module& m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("bind_caches", &DecoderStack::bind_caches)
      .def("bind_quantized_caches", &DecoderStack::bind_quantized_caches)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward);
}
