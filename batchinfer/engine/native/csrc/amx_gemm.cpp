// y = x @ W.T (+ bias) for float32 x and W on AMX's bf16 tiles, each float32 taken as the sum of two
// bfloat16s (bf16x3, what torch.set_float32_matmul_precision("high") names "the sum of two bfloat16
// numbers"): x W = xh Wh + xh Wl + xl Wh, the three products in float32 (xl Wl, ~2^-16 of the sum, dropped).
// On a 2-core AMX Xeon bf16 tiles run ~8x the AVX-512 fp32 FMAs, so three passes still win wherever the
// GEMM is not bound by streaming its weights (16 rows up). engine/layers/amx_linear.py's AmxLinear runs it
// under float32_matmul_precision "high" (every step) or "auto" (embeddings); its docstring has the error.
// A non-finite x or W value makes its outputs nan where IEEE float32 may give +-inf (inf - inf residues,
// inf x 0 products): a model whose activations overflow has no usable output either way.
//
// Layout (pack_amx_weight): [NB / 2, KB, 4, 16, 32] bfloat16 with NB = N/16 and KB = K/32 rounded up (NB
// even; padding is zero). Column tiles go in pairs; per pair and k step, four AMX B operands one after the
// other: the high halves Wh of column tiles 2p and 2p + 1, then their residues Wl = bf16(W - Wh), so a
// thread's weights stream as one sequential run (four separate streams ran 1-16 row steps at 2/3 the
// bandwidth). A B operand for output columns 16 nb .. 16 nb + 15 and k = 32 kb .. 32 kb + 31 is in VNNI
// order: its row r holds, per column j, the pair (W[16 nb + j, 32 kb + 2 r], W[16 nb + j, 32 kb + 2 r + 1]).

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATCHINFER_AMX 1
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kTileCols = 16;  // output columns of one accumulator tile (16 float32 = 64 bytes)
constexpr int64_t kTileK = 32;     // k per tile step: 16 rows of bf16 pairs
constexpr int64_t kBlockRows = 32;  // rows of x per block: two 16-row accumulator tiles
constexpr int64_t kBlockCols = 2 * kTileCols;  // output columns per block: one column-tile pair
// Rows whose bf16 halves stay in L2 while a thread's weights go by (with 256, and the halves zero-filled per
// call, 4096-row GEMMs ran 543 rather than 880 GFLOP/s; both changed at once).
constexpr int64_t kChunkRows = 128;
// Weight k steps (4 KiB each) the first block of a chunk prefetches ahead of its tile loads, which stall on
// memory otherwise (bench/panel_gemm.py, 1-32 row steps of SmolLM2: 29 -> 26 ms; 4 or 6 steps no better).
constexpr int64_t kPrefetchSteps = 2;

#if defined(BATCHINFER_AMX)

// x [M, K] float32 -> its high halves and residues as bf16 [Mp, Kp] (row stride Kp, zero-padded).
void split_rows(const float* x, int64_t M, int64_t K, int64_t Kp, bf16* high, bf16* low) {
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x + r * K;
      auto* hi = reinterpret_cast<uint16_t*>(high + r * Kp);
      auto* lo = reinterpret_cast<uint16_t*>(low + r * Kp);
      for (int64_t k = 0; k < Kp; k += 16) {
        // past K (the last columns, and Kp's padding) the loads read nothing and the halves are zero
        const int64_t valid = std::clamp<int64_t>(K - k, 0, 16);
        const __mmask16 mask = __mmask16((uint32_t(1) << valid) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(mask, src + k);
        const __m256bh h = _mm512_cvtneps_pbh(v);
        const __m512 widened = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
        const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, widened));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + k), reinterpret_cast<const __m256i&>(h));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + k), reinterpret_cast<const __m256i&>(l));
      }
    }
  });
}

// One 32 x 32 block: rows m0.. of the split x times one column-tile pair of the packed weight (its KB
// steps of 4 tiles), into out [kBlockRows, kBlockCols] float32. tmm0-3: the 2 x 2 accumulators; tmm4-5:
// x's two 16-row tiles; tmm6-7: the pair's two column tiles. Products in the order xh Wl, xh Wh, xl Wh (the
// small terms first) per k step: 8 tile loads per 12 TDPs.
void block(const bf16* xh, const bf16* xl, int64_t ldx_bytes, const bf16* pair, int64_t KB, bool prefetch,
           float* out) {
  constexpr int64_t kTileElems = 16 * kTileK;  // bf16 per weight tile
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t row16 = 16 * ldx_bytes;  // bytes from x's first 16-row tile to its second
  for (int64_t kb = 0; kb < KB; ++kb) {
    const auto* ah = reinterpret_cast<const char*>(xh + kb * kTileK);
    const auto* al = reinterpret_cast<const char*>(xl + kb * kTileK);
    const bf16* wh = pair + kb * 4 * kTileElems;  // Wh of tiles 2p, 2p + 1, then their Wl
    if (prefetch) {  // kPrefetchSteps k steps ahead (past the pair's end: the thread's next pair, or beyond)
      const auto* lines = reinterpret_cast<const char*>(wh + kPrefetchSteps * 4 * kTileElems);
      for (int64_t line = 0; line < 4 * kTileElems * int64_t(sizeof(bf16)); line += 64)
        _mm_prefetch(lines + line, _MM_HINT_T0);
    }
    _tile_loadd(4, ah, ldx_bytes);
    _tile_loadd(5, ah + row16, ldx_bytes);
    _tile_loadd(6, wh + 2 * kTileElems, 64);
    _tile_loadd(7, wh + 3 * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, wh, 64);
    _tile_loadd(7, wh + kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(4, al, ldx_bytes);
    _tile_loadd(5, al + row16, ldx_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t ld = kBlockCols * sizeof(float);  // out is [kBlockRows, kBlockCols]
  _tile_stored(0, out, ld);
  _tile_stored(1, out + kTileCols, ld);
  _tile_stored(2, out + 16 * kBlockCols, ld);
  _tile_stored(3, out + 16 * kBlockCols + kTileCols, ld);
}

// block for a last block of at most 16 rows (a decode step of up to 16 sequences is one): rows 0-15 of
// out only. tmm0-1 accumulate the pair's two column tiles; x's halves (tmm2-3) and the pair's four weight
// tiles (tmm4-7) load once per k step, so no tile is reloaded while products that read it are in flight
// (tiles have no renaming). block's 2 x 2 accumulators reuse each operand more at 32 rows (850 against
// ~700 GFLOP/s on a hot 1536 x 576 GEMM at 96 rows), but at 1-16 rows half of its products would be padding:
// this one ran a SmolLM2 step of 121 GEMMs in 23-24 ms there against block's 28 (bench/panel_gemm.py).
void half_block(const bf16* xh, const bf16* xl, int64_t ldx_bytes, const bf16* pair, int64_t KB,
                bool prefetch, float* out) {
  constexpr int64_t kTileElems = 16 * kTileK;  // bf16 per weight tile
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const bf16* wh = pair + kb * 4 * kTileElems;  // Wh of tiles 2p, 2p + 1, then their Wl
    if (prefetch) {  // as in block
      const auto* lines = reinterpret_cast<const char*>(wh + kPrefetchSteps * 4 * kTileElems);
      for (int64_t line = 0; line < 4 * kTileElems * int64_t(sizeof(bf16)); line += 64)
        _mm_prefetch(lines + line, _MM_HINT_T0);
    }
    _tile_loadd(2, xh + kb * kTileK, ldx_bytes);
    _tile_loadd(3, xl + kb * kTileK, ldx_bytes);
    _tile_loadd(4, wh, 64);
    _tile_loadd(5, wh + kTileElems, 64);
    _tile_loadd(6, wh + 2 * kTileElems, 64);
    _tile_loadd(7, wh + 3 * kTileElems, 64);
    _tile_dpbf16ps(0, 2, 6);  // xh Wl, xh Wh, xl Wh, as in block
    _tile_dpbf16ps(1, 2, 7);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
  }
  constexpr int64_t ld = kBlockCols * sizeof(float);
  _tile_stored(0, out, ld);
  _tile_stored(1, out + kTileCols, ld);
}

#endif

}  // namespace

bool amx_gemm_built() {
#if defined(BATCHINFER_AMX)
  return request_amx_tiles();
#else
  return false;
#endif
}

torch::Tensor pack_amx_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_amx_weight: a float32 [N, K] CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t NB = 2 * ((N + kBlockCols - 1) / kBlockCols), KB = (K + kTileK - 1) / kTileK;
  torch::Tensor padded = torch::zeros({NB * kTileCols, KB * kTileK}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  torch::Tensor high = padded.to(at::kBFloat16);
  torch::Tensor low = (padded - high.to(at::kFloat)).to(at::kBFloat16);
  // [NB*16, KB*32] -> [NB/2, 2 tiles, 16 cols, KB, 16 pairs, 2] -> [NB/2, KB, 2 tiles, 16 pairs, 16 cols, 2]
  auto tiles = [&](const torch::Tensor& w) {
    return w.view({NB / 2, 2, kTileCols, KB, kTileK / 2, 2}).permute({0, 3, 1, 4, 2, 5});
  };
  // -> [NB/2, KB, (high, low) x 2 tiles, 16, 32]
  return torch::stack({tiles(high), tiles(low)}, 2).reshape({NB / 2, KB, 4, 16, 32}).contiguous();
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features) {
#if defined(BATCHINFER_AMX)
  TORCH_CHECK(request_amx_tiles(), "amx_linear: the kernel refused AMX's tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "amx_linear: x a float32 [M, K] CPU tensor");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 4 && packed.size(3) == 16 && packed.size(4) == 32 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear: packed [NB / 2, KB, 4, 16, 32] bfloat16 from pack_amx_weight");
  const int64_t M = x.size(0), K = x.size(1), NB = 2 * packed.size(0), KB = packed.size(1), N = out_features;
  TORCH_CHECK(K > (KB - 1) * kTileK && K <= KB * kTileK, "amx_linear: x's K does not fit the packed weight");
  TORCH_CHECK(N > (NB - 2) * kTileCols && N <= NB * kTileCols, "amx_linear: out_features does not fit");
  torch::Tensor bf;
  if (bias.has_value() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == N, "amx_linear: bias of out_features values");
    bf = bias->to(at::kFloat).contiguous();
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t Mp = (M + kBlockRows - 1) / kBlockRows * kBlockRows, Kp = KB * kTileK;
  // split_rows writes rows < M up to Kp (zeros past K); the padding rows are zeroed here
  torch::Tensor halves = torch::empty({2, Mp, Kp}, x.options().dtype(at::kBFloat16));
  if (Mp > M) halves.narrow(1, M, Mp - M).zero_();
  const torch::Tensor xc = x.contiguous();
  bf16* xh = halves.data_ptr<at::BFloat16>();
  bf16* xl = xh + Mp * Kp;
  split_rows(xc.data_ptr<float>(), M, K, Kp, xh, xl);
  const bf16* weights = packed.data_ptr<at::BFloat16>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx_bytes = Kp * int64_t(sizeof(bf16)), pairs = NB / 2;
  // Each thread takes a contiguous run of column-tile pairs (its weights) and, chunk by chunk of rows,
  // every 32-row block against each of them.
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    configure_amx_tiles();
    alignas(64) float out[kBlockRows * kBlockCols];
    for (int64_t c0 = 0; c0 < Mp; c0 += kChunkRows) {
      const int64_t c1 = std::min(Mp, c0 + kChunkRows);
      for (int64_t p = p0; p < p1; ++p) {
        const bf16* pair = weights + p * KB * 4 * 16 * kTileK;
        const int64_t n0 = 2 * p * kTileCols;
        const int64_t columns = std::min<int64_t>(kBlockCols, N - n0);
        for (int64_t m0 = c0; m0 < c1; m0 += kBlockRows) {
          if (M - m0 <= 16)
            half_block(xh + m0 * Kp, xl + m0 * Kp, ldx_bytes, pair, KB, m0 == c0, out);
          else
            block(xh + m0 * Kp, xl + m0 * Kp, ldx_bytes, pair, KB, m0 == c0, out);
          store_block_rows(out, kBlockCols, std::min(kBlockRows, M - m0), columns, bp ? bp + n0 : nullptr,
                           yp + m0 * N + n0, N);
        }
      }
    }
    _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX bf16 (amx_gemm_built() is false)");
  return {};
#endif
}
