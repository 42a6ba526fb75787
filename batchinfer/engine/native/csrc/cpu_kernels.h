// batchinfer's native CPU kernels: the includes every source shares and the functions the extension exports
// (bound to Python in bindings.cpp, called from engine/layers/cpu_attention.py and the layers).
// Built by engine/layers/native_build.py with -O3 -march=native -ffast-math -fopenmp; the cache key hashes
// every file in this folder, so any edit here means one rebuild.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

using bf16 = at::BFloat16;

// paged_attention.cpp
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
void paged_decode_attention_quantized(torch::Tensor out, torch::Tensor q, torch::Tensor k_codes,
                                      torch::Tensor v_codes, torch::Tensor k_params, torch::Tensor v_params,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
std::string set_decode_attention_isa(const std::string& name);  // caps the path; returns the one taken
std::string decode_attention_isa();                               // the path the kernels take now
// The item bounds decode attention splits its work at between `parts` threads (tests, benches).
std::vector<int64_t> decode_attention_runs(torch::Tensor seq_lens, int64_t kv_heads, int64_t parts);

// fused_ops.cpp
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor silu_and_mul(torch::Tensor x);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps);
void store_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
               torch::Tensor slots, c10::optional<torch::Tensor> rows);
// k, v quantized per (token, kv head) row into int8 / uint8 codes and float32 params (kv_quant.py's formats)
void store_kv_quantized_(torch::Tensor k, torch::Tensor v, torch::Tensor k_codes, torch::Tensor v_codes,
                         torch::Tensor k_params, torch::Tensor v_params, torch::Tensor slots,
                         c10::optional<torch::Tensor> rows);
std::vector<torch::Tensor> scale_rows(torch::Tensor x, double floor);

// gguf_linear.cpp
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                        int64_t tile_rows);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, int64_t tile_rows);

// panel_gemm.cpp
bool panel_gemm_built();  // compiled with AVX2 + FMA (panel_linear runs)
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias,
                           int64_t out_features);

// amx_gemm.cpp
bool amx_gemm_built();  // compiled with AMX bf16 and granted the tile state (amx_linear runs)
torch::Tensor pack_amx_weight(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features);

// amx_block_gemm.cpp: float32 x times a weight of 4-bit blocks (W = d q + m per 32 inputs) in float32
// arithmetic on AMX bf16 tiles (exact products); runs where amx_gemm_built().
std::vector<torch::Tensor> pack_amx_blocks(torch::Tensor q, torch::Tensor d, torch::Tensor m);
torch::Tensor amx_block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               c10::optional<torch::Tensor> bias, int64_t out_features);

// greedy_head.cpp
// Greedy rows of a float32 LM head: out[rows[r]] = x[r] . w_v for the tokens v that can be row r's argmax
// (screened from approx[r], the bf16 GEMM of the row), -inf for the others; returns the candidates counted.
int64_t screen_argmax_logits(torch::Tensor out, torch::Tensor approx, torch::Tensor x, torch::Tensor weight,
                             torch::Tensor weight_norms, torch::Tensor rows, double rel_slack,
                             double out_slack, double denormal_slack);
