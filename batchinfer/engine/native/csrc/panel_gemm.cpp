// y = x @ W.T (+ bias) over a weight packed once into column panels: the float32 / bfloat16 linears of an
// AVX2-only CPU, the float32 ones of an AVX-512 CPU with AMX (where it was measured), and any with
// BATCHINFER_CPU_LINEAR=panel (engine/layers/weight_packing.py's PanelLinear and panel_gemm_preferred).
//
// Why: a decode step's GEMMs have few rows (one per sequence) against weights that stream from memory
// every step. oneDNN's AVX2 fp32 GEMM (AVX2-only CPUs have no brgemm) paid its weight traffic and its
// arithmetic one after the other: on the AVX2 bench machine a step's 121 GEMMs of SmolLM2 took ~45 ms of
// weight streaming plus ~1.75 ms per row; on the AVX-512 one oneDNN's 1-row step streamed at 20 GB/s.
// Here each thread streams its own contiguous run of panels once and multiplies every row against a
// panel while it sits in L1/L2: in a 6 x 16 register tile (AVX2), or 14 x 32 (AVX-512, below).
//
// Layout (pack_panels): [P, K, 16] with P = ceil(N / 16); element (p, k, j) is W[16 p + j, k], the last
// panel zero-padded. float32 or bfloat16: a bf16 panel is widened to float32 (exactly: a bf16 is the
// high half of a float32) in registers (AVX2: when at most two tiles read it, else once per row pass
// and panel into a thread's buffer), so bf16 weights stream half the bytes and the arithmetic stays
// float32 (bf16 activations are widened on entry and the output rounded back once).
// Summation runs in k order per output, so results differ from oneDNN's in the last bits only.

#include "cpu_kernels.h"

namespace {

constexpr int64_t kPanel = 16;    // output columns per panel: two 8-float registers, or one 16-float one
constexpr int64_t kTileRows = 6;  // rows per register tile: 12 accumulators + 2 weights + 1 broadcast
// Rows of x per pass over the panels: x's rows stay in L2 while the thread's panels go by (more rows
// are prefill, whose weights come back from L3 once per pass).
constexpr int64_t kRowsPerPass = 126;
// Rows up to which a bf16 panel is widened in registers by each tile (4 more vector ops per k and tile)
// rather than once into a buffer (a write and a read of the panel): 1-row steps 25 -> 17 ms on SmolLM2.
constexpr int64_t kRegisterWidenRows = 2 * kTileRows;
constexpr int64_t kCacheLine = 64;
// Rows from which tiles prefetch the next panel (run_tiles): float32 panels, and bf16 ones widened into a
// buffer (more than kRegisterWidenRows rows). Measured on an AVX2 EPYC (Zen 3) over SmolLM2's 121 GEMMs,
// builds alternating step by step (bench/kernel_ab.py, 25 steps each): float32 1.07x at 4 rows, 1.00x at 8,
// 1.09x at 12 and 16, 1.10x at 24, 1.03x at 32, 0.98x at 48, 1.06x at 96, where identical code read 0.97x;
// buffered bf16 1.01-1.12x at 16-96 (two runs). At 1-2 rows the tiles only stream and the hardware
// prefetcher keeps up (0.95-1.10x); bf16 widened in registers (up to 12 rows, more work per k step)
// measured 0.91-1.00x. The line count rounds down: a bf16 panel of odd K misses its last half line.
constexpr int64_t kPrefetchMinRows = 4;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)  // the AVX2 tiles (AVX-512: below)

#define PANEL_ROW(i)                                                              \
  if constexpr (R > i) {                                                          \
    const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);                        \
    acc##i##0 = _mm256_fmadd_ps(a, w0, acc##i##0);                                \
    acc##i##1 = _mm256_fmadd_ps(a, w1, acc##i##1);                                \
  }
#define PANEL_STORE(i)                                                            \
  if constexpr (R > i) store_tile_row(acc##i##0, acc##i##1, bias, y + i * ldy, columns);

inline void store_tile_row(__m256 lo, __m256 hi, const float* bias, float* y, int64_t columns) {
  if (bias != nullptr) {
    if (columns == kPanel) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    } else {
      alignas(32) float padded[kPanel] = {};
      std::memcpy(padded, bias, columns * sizeof(float));
      lo = _mm256_add_ps(lo, _mm256_load_ps(padded));
      hi = _mm256_add_ps(hi, _mm256_load_ps(padded + 8));
    }
  }
  if (columns == kPanel) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float row[kPanel];
  _mm256_store_ps(row, lo);
  _mm256_store_ps(row + 8, hi);
  std::memcpy(y, row, columns * sizeof(float));
}

inline __m256 load_weights(const float* w) { return _mm256_loadu_ps(w); }

inline __m256 load_weights(const bf16* w) {  // 8 bf16 -> 8 float32, exactly (the high halves)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// R rows of x [R, K] (row stride ldx) times one panel [K, 16] -> y [R, columns] (row stride ldy), and
// `ahead_lines` cache lines from `ahead` (the thread's next panel) prefetched into L2, one per k step.
// Named accumulators, not an array: GCC kept an array's registers but stored them to the stack on every k.
template <int R, typename W>
void panel_tile(const float* __restrict x, int64_t ldx, const W* __restrict panel, int64_t K,
                const float* bias, float* __restrict y, int64_t ldy, int64_t columns, const char* ahead,
                int64_t ahead_lines) {
  __m256 acc00 = _mm256_setzero_ps(), acc01 = acc00, acc10 = acc00, acc11 = acc00, acc20 = acc00,
         acc21 = acc00, acc30 = acc00, acc31 = acc00, acc40 = acc00, acc41 = acc00, acc50 = acc00,
         acc51 = acc00;
  for (int64_t k = 0; k < K; ++k) {
    if (k < ahead_lines) _mm_prefetch(ahead + k * kCacheLine, _MM_HINT_T1);
    const __m256 w0 = load_weights(panel + k * kPanel), w1 = load_weights(panel + k * kPanel + 8);
    PANEL_ROW(0) PANEL_ROW(1) PANEL_ROW(2) PANEL_ROW(3) PANEL_ROW(4) PANEL_ROW(5)
  }
  PANEL_STORE(0) PANEL_STORE(1) PANEL_STORE(2) PANEL_STORE(3) PANEL_STORE(4) PANEL_STORE(5)
}

#undef PANEL_ROW
#undef PANEL_STORE

void widen_panel(const bf16* __restrict panel, int64_t count, float* __restrict out) {
  const auto* bits = reinterpret_cast<const uint16_t*>(panel);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < count; ++i) out[i] = static_cast<float>(panel[i]);
}

// Rows [row0, row0 + rows) of x against one panel (float32, or bf16 widened in registers or into a
// buffer: `panel` is what the tiles read, `stored` the panel as packed), its tiles prefetching the
// `ahead_bytes` after `stored` (the thread's next panel; 0 where run_panels takes no prefetch) between
// them, so that memory streams the next panel while the later tiles compute on this one from L2: without
// it a step paid its weights' streaming and their arithmetic one after the other.
template <typename W, typename P>
void run_tiles(const float* x, int64_t K, const W* panel, const float* bias, float* y, int64_t N,
               int64_t row0, int64_t rows, int64_t p, const P* stored, int64_t ahead_bytes) {
  const int64_t columns = std::min(kPanel, N - p * kPanel);
  const float* panel_bias = bias != nullptr ? bias + p * kPanel : nullptr;
  const char* ahead = reinterpret_cast<const char*>(stored + K * kPanel);
  const int64_t lines = ahead_bytes / kCacheLine;
  for (int64_t r = row0; r < row0 + rows; r += kTileRows) {
    const float* xr = x + r * K;
    float* yr = y + r * N + p * kPanel;
    const int64_t tile_rows = std::min(kTileRows, row0 + rows - r);
    // each tile its rows' share of the lines (a short last tile has less time to hide them): <= K, one per k
    const int64_t first = lines * (r - row0) / rows, count = lines * (r - row0 + tile_rows) / rows - first;
    const char* at = ahead + first * kCacheLine;
    switch (tile_rows) {  // a compile-time tile: its accumulators in registers
      case 6: panel_tile<6>(xr, K, panel, K, panel_bias, yr, N, columns, at, count); break;
      case 5: panel_tile<5>(xr, K, panel, K, panel_bias, yr, N, columns, at, count); break;
      case 4: panel_tile<4>(xr, K, panel, K, panel_bias, yr, N, columns, at, count); break;
      case 3: panel_tile<3>(xr, K, panel, K, panel_bias, yr, N, columns, at, count); break;
      case 2: panel_tile<2>(xr, K, panel, K, panel_bias, yr, N, columns, at, count); break;
      default: panel_tile<1>(xr, K, panel, K, panel_bias, yr, N, columns, at, count); break;
    }
  }
}

// Rows [row0, row0 + rows) of x against panels [p0, p1). A bf16 panel read by up to kRegisterWidenRows rows
// is widened in registers; read by more, it is widened once into `widened` (the tiles then load float32).
template <typename W>
void run_panels(const float* x, int64_t K, const W* panels, const float* bias, float* y, int64_t N,
                int64_t row0, int64_t rows, int64_t p0, int64_t p1, std::vector<float>& widened) {
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = panels + p * K * kPanel;
    const bool prefetch = (std::is_same_v<W, float> || rows > kRegisterWidenRows) && rows >= kPrefetchMinRows &&
                          p + 1 < p1;
    const int64_t ahead_bytes = prefetch ? K * kPanel * int64_t(sizeof(W)) : 0;
    if constexpr (std::is_same_v<W, float>) {
      run_tiles(x, K, panel, bias, y, N, row0, rows, p, panel, ahead_bytes);
    } else if (rows <= kRegisterWidenRows) {
      run_tiles(x, K, panel, bias, y, N, row0, rows, p, panel, ahead_bytes);
    } else {
      widen_panel(panel, K * kPanel, widened.data());
      run_tiles(x, K, static_cast<const float*>(widened.data()), bias, y, N, row0, rows, p, panel, ahead_bytes);
    }
  }
}

#endif

#if defined(__AVX512F__)

// AVX-512: a panel's 16 columns are one zmm, so a tile is R rows x 2 panels (R up to kWideTileRows, two
// registers per row) and a k step is two weight loads (widened in registers when bf16) plus 2R FMAs whose
// x operand is a broadcast from memory: R + 2 loads per 2R FMAs, so the FMAs, not the loads, set the pace
// (a one-panel tile needs a load per FMA: on an AMX Xeon its 28-row tile ran 0.79-0.88x oneDNN from 32
// rows up). Up to 14 rows read a panel pair once (its stream, prefetched, overlaps their arithmetic);
// more rows read it once per tile, from L2 after the first. A thread's odd last panel runs the same
// tiles one register wide. x is first copied tile by tile k-major ([K, R] per tile): the R values of a k
// step are then adjacent, one pointer plus constant offsets (14 row pointers would take most of the 16
// general registers, and rows at a stride of a multiple of 1 KiB evict one another in L1).
constexpr int64_t kWideTileRows = 14;  // 28 accumulators + 2 weights (of 32 registers)
static_assert(kWideTileRows <= 16, "a tile's rows are one gather's lanes (pack_wide_tiles)");
// Rows per pass over the panels (36 tiles): every pass streams all the weights again, and fewer passes
// paid more than x's rows leaving L2 (AMX Xeon, L2 2 MiB per core: 256 rows from 0.92x to 0.98x oneDNN's
// speed with 126 -> 504 rows a pass).
constexpr int64_t kWideRowsPerPass = 36 * kWideTileRows;
// k steps ahead that a tile prefetches each of its panels (near a panel's end, into the panel after it):
// 2 KiB of float32, 1 KiB of bf16 (whose 32-byte rows prefetch each line twice, for free).
constexpr int64_t kWidePrefetchSteps = 32;

struct WideTile {
  int64_t row0, rows;  // x's rows [row0, row0 + rows); packed at row0 * K, element (k, i) at k * rows + i
};

// M rows as passes of kWideRowsPerPass, each cut into near-equal tiles of at most kWideTileRows.
std::vector<WideTile> wide_tiles(int64_t M) {
  std::vector<WideTile> out;
  for (int64_t row0 = 0; row0 < M; row0 += kWideRowsPerPass) {
    const int64_t rows = std::min(kWideRowsPerPass, M - row0);
    const int64_t count = (rows + kWideTileRows - 1) / kWideTileRows;
    for (int64_t t = 0, r = row0; t < count; ++t) {
      const int64_t tile_rows = (rows - (r - row0) + (count - t) - 1) / (count - t);
      out.push_back({r, tile_rows});
      r += tile_rows;
    }
  }
  return out;
}

// x [M, K] -> out [M, K] with each tile's rows k-major at the tile's offset (row0 * K): per k, one gather of
// the tile's rows (each row's cache line serves 16 k in a row): an N = 32 GEMM of a 96 x 1536 x took 0.155
// ms with a scalar copy, 0.090 ms with the gathers. Offsets i * K are int32 (panel_linear checks K).
void pack_wide_tiles(const float* __restrict x, int64_t K, const std::vector<WideTile>& tiles,
                     float* __restrict out) {
  at::parallel_for(0, int64_t(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [row0, rows] = tiles[t];
      const float* src = x + row0 * K;
      float* dst = out + row0 * K;
      const __mmask16 mask = __mmask16((1u << rows) - 1);
      const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                   14, 15),
                                                 _mm512_set1_epi32(int32_t(K)));
      for (int64_t k = 0; k < K; ++k) {
        const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, offsets, src + k, 4);
        _mm512_mask_storeu_ps(dst + k * rows, mask, column);
      }
    }
  });
}

inline __m512 load_wide_weights(const float* w) { return _mm512_loadu_ps(w); }

inline __m512 load_wide_weights(const bf16* w) {  // 16 bf16 -> 16 float32, exactly (the high halves)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 column_mask(int64_t columns) {
  return columns == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << columns) - 1);
}

inline void store_wide_row(__m512 acc, const float* bias, float* y, int64_t columns) {
  const __mmask16 mask = column_mask(columns);
  if (bias != nullptr) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(y, mask, acc);
}

#define WIDE_ROW(i)                                                           \
  if constexpr (R > i) {                                                      \
    const __m512 a = _mm512_set1_ps(xk[i]);                                   \
    acc##i = _mm512_fmadd_ps(a, w, acc##i);                                   \
    if constexpr (kPanels == 2) hi##i = _mm512_fmadd_ps(a, w_hi, hi##i);      \
  }
#define WIDE_STORE(i)                                                                 \
  if constexpr (R > i) {                                                              \
    store_wide_row(acc##i, bias, y + i * ldy, kPanels == 2 ? kPanel : columns);       \
    if constexpr (kPanels == 2)                                                       \
      store_wide_row(hi##i, bias == nullptr ? nullptr : bias + kPanel, y + i * ldy + kPanel, columns); \
  }

// One tile's x, k-major [K, R], times kPanels adjacent panels [K, 16] (the second one panel_stride
// elements after the first) -> y [R, 16 (kPanels - 1) + columns] (row stride ldy; `columns` is the last
// panel's). Named accumulators, not an array: GCC kept an array's registers but stored them to the stack
// on every k (the AVX2 tile above).
template <int R, int kPanels, typename W>
void wide_tile(const float* __restrict x, const W* __restrict panel, int64_t panel_stride, int64_t K,
               const float* bias, float* __restrict y, int64_t ldy, int64_t columns) {
  const W* __restrict panel_hi = panel + panel_stride;  // the second panel (read only when kPanels == 2)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0,
         acc6 = acc0, acc7 = acc0, acc8 = acc0, acc9 = acc0, acc10 = acc0, acc11 = acc0, acc12 = acc0,
         acc13 = acc0;
  __m512 hi0 = acc0, hi1 = acc0, hi2 = acc0, hi3 = acc0, hi4 = acc0, hi5 = acc0, hi6 = acc0, hi7 = acc0,
         hi8 = acc0, hi9 = acc0, hi10 = acc0, hi11 = acc0, hi12 = acc0, hi13 = acc0;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kWidePrefetchSteps) * kPanel), _MM_HINT_T0);
    const __m512 w = load_wide_weights(panel + k * kPanel);
    __m512 w_hi = w;
    if constexpr (kPanels == 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel_hi + (k + kWidePrefetchSteps) * kPanel), _MM_HINT_T0);
      w_hi = load_wide_weights(panel_hi + k * kPanel);
    }
    const float* xk = x + k * R;
    WIDE_ROW(0) WIDE_ROW(1) WIDE_ROW(2) WIDE_ROW(3) WIDE_ROW(4) WIDE_ROW(5) WIDE_ROW(6) WIDE_ROW(7)
    WIDE_ROW(8) WIDE_ROW(9) WIDE_ROW(10) WIDE_ROW(11) WIDE_ROW(12) WIDE_ROW(13)
  }
  WIDE_STORE(0) WIDE_STORE(1) WIDE_STORE(2) WIDE_STORE(3) WIDE_STORE(4) WIDE_STORE(5) WIDE_STORE(6)
  WIDE_STORE(7) WIDE_STORE(8) WIDE_STORE(9) WIDE_STORE(10) WIDE_STORE(11) WIDE_STORE(12) WIDE_STORE(13)
}

#undef WIDE_ROW
#undef WIDE_STORE

// A tile of `rows` (1..kWideTileRows) rows: the row count picks the compile-time tile.
template <int kPanels, int R = kWideTileRows, typename W>
void wide_rows(int64_t rows, const float* x, const W* panel, int64_t panel_stride, int64_t K, const float* bias,
               float* y, int64_t ldy, int64_t columns) {
  if constexpr (R > 1) {
    if (rows < R) return wide_rows<kPanels, R - 1>(rows, x, panel, panel_stride, K, bias, y, ldy, columns);
  }
  wide_tile<R, kPanels>(x, panel, panel_stride, K, bias, y, ldy, columns);
}

// The tiles of one pass (packed x) against panels [p0, p1): two at a time, the odd last one alone.
template <typename W>
void run_wide_panels(const float* packed, int64_t K, const W* panels, const float* bias, float* y, int64_t N,
                     const WideTile* tiles, int64_t count, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1;) {
    const W* panel = panels + p * K * kPanel;
    const bool pair = p + 1 < p1;
    const int64_t columns = std::min(kPanel, N - (p + (pair ? 1 : 0)) * kPanel);  // the last panel's
    const float* panel_bias = bias != nullptr ? bias + p * kPanel : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      const auto [row0, rows] = tiles[t];
      float* yt = y + row0 * N + p * kPanel;
      if (pair)
        wide_rows<2>(rows, packed + row0 * K, panel, K * kPanel, K, panel_bias, yt, N, columns);
      else
        wide_rows<1>(rows, packed + row0 * K, panel, K * kPanel, K, panel_bias, yt, N, columns);
    }
    p += pair ? 2 : 1;
  }
}

#endif

}  // namespace

bool panel_gemm_built() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: a [N, K] weight");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_panels: a float32 or bfloat16 weight");
  TORCH_CHECK(weight.device().is_cpu(), "pack_panels: a CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  torch::Tensor padded = weight.contiguous();
  if (N != P * kPanel) padded = torch::cat({padded, padded.new_zeros({P * kPanel - N, K})});
  // [P * 16, K] -> [P, 16, K] -> [P, K, 16]
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias,
                           int64_t out_features) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && x.size(1) == panels.size(1),
              "panel_linear: x [M, K] and panels [P, K, 16]");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() &&
                  (!bias.has_value() || bias->device().is_cpu()),
              "panel_linear: CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "panel_linear: out_features does not fit the panels");
  TORCH_CHECK(K <= INT32_MAX / 16, "panel_linear: K too large for the int32 gather offsets of a tile");
  TORCH_CHECK(panels.is_contiguous() &&
                  (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "panel_linear: contiguous float32 or bfloat16 panels");
  const auto out_dtype = x.scalar_type();
  torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor bf;
  if (bias.has_value() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == N, "panel_linear: bias of out_features values");
    bf = bias->to(at::kFloat).contiguous();
  }
  torch::Tensor y = torch::empty({M, N}, xf.options());
  if (M == 0) return y.to(out_dtype);
#if defined(__AVX512F__)
  const std::vector<WideTile> tiles = wide_tiles(M);
  if (M > 1) {
    torch::Tensor packed = torch::empty_like(xf);
    pack_wide_tiles(xf.data_ptr<float>(), K, tiles, packed.data_ptr<float>());
    xf = packed;
  }
#endif
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool widen = panels.scalar_type() == at::kBFloat16;
  // Each thread takes one contiguous run of panels (they stream from memory once per pass) and, pass by
  // pass, every row against it. AVX-512 tiles read panels in pairs: a run starts at an even panel.
#if defined(__AVX512F__)
  constexpr int64_t kPanelGrain = 2;
#else
  constexpr int64_t kPanelGrain = 1;
#endif
  at::parallel_for(0, (P + kPanelGrain - 1) / kPanelGrain, 1, [&](int64_t g0, int64_t g1) {
    const int64_t p0 = g0 * kPanelGrain, p1 = std::min(P, g1 * kPanelGrain);
#if defined(__AVX512F__)
    // pass by pass: a pass starts at a multiple of kWideRowsPerPass
    for (size_t first = 0; first < tiles.size();) {
      size_t last = first + 1;
      while (last < tiles.size() && tiles[last].row0 % kWideRowsPerPass != 0) ++last;
      const auto count = int64_t(last - first);
      if (widen)
        run_wide_panels(xp, K, panels.data_ptr<at::BFloat16>(), bp, yp, N, &tiles[first], count, p0, p1);
      else
        run_wide_panels(xp, K, panels.data_ptr<float>(), bp, yp, N, &tiles[first], count, p0, p1);
      first = last;
    }
#else
    std::vector<float> widened(widen && M > kRegisterWidenRows ? K * kPanel : 0);
    for (int64_t row0 = 0; row0 < M; row0 += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, M - row0);
      if (widen)
        run_panels(xp, K, panels.data_ptr<at::BFloat16>(), bp, yp, N, row0, rows, p0, p1, widened);
      else
        run_panels(xp, K, panels.data_ptr<float>(), bp, yp, N, row0, rows, p0, p1, widened);
    }
#endif
  });
  return out_dtype == at::kFloat ? y : y.to(out_dtype);
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX2/FMA (panel_gemm_built() is false)");
  return {};
#endif
}
