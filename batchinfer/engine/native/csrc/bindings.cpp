// The extension's Python module: one entry per exported function, each wrapped so that a failed
// TORCH_CHECK raises a Python RuntimeError (what torch.utils.cpp_extension.load_inline generated before).
#include <torch/extension.h>

#include "cpu_kernels.h"
#include "decoder_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", torch::wrap_pybind_function(paged_decode_attention), "paged_decode_attention");
  m.def("paged_decode_attention_quantized", torch::wrap_pybind_function(paged_decode_attention_quantized),
        "paged_decode_attention_quantized");
  m.def("set_decode_attention_isa", &set_decode_attention_isa, "set_decode_attention_isa");
  m.def("decode_attention_isa", &decode_attention_isa, "decode_attention_isa");
  m.def("decode_attention_runs", torch::wrap_pybind_function(decode_attention_runs), "decode_attention_runs");
  m.def("rotary_", torch::wrap_pybind_function(rotary_), "rotary_");
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul), "silu_and_mul");
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("store_kv_", torch::wrap_pybind_function(store_kv_), "store_kv_");
  m.def("store_kv_quantized_", torch::wrap_pybind_function(store_kv_quantized_), "store_kv_quantized_");
  m.def("scale_rows", torch::wrap_pybind_function(scale_rows), "scale_rows");
  m.def("q4_linear", torch::wrap_pybind_function(q4_linear), "q4_linear");
  m.def("q8_linear", torch::wrap_pybind_function(q8_linear), "q8_linear");
  m.def("panel_gemm_built", &panel_gemm_built, "panel_gemm_built");
  m.def("pack_panels", torch::wrap_pybind_function(pack_panels), "pack_panels");
  m.def("panel_linear", torch::wrap_pybind_function(panel_linear), "panel_linear");
  m.def("amx_gemm_built", &amx_gemm_built, "amx_gemm_built");
  m.def("pack_amx_weight", torch::wrap_pybind_function(pack_amx_weight), "pack_amx_weight");
  m.def("amx_linear", torch::wrap_pybind_function(amx_linear), "amx_linear");
  m.def("pack_amx_blocks", torch::wrap_pybind_function(pack_amx_blocks), "pack_amx_blocks");
  m.def("amx_block_linear", torch::wrap_pybind_function(amx_block_linear), "amx_block_linear");
  m.def("screen_argmax_logits", torch::wrap_pybind_function(screen_argmax_logits), "screen_argmax_logits");
  bind_decoder_stack(m);
}
