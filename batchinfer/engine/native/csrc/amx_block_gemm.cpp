// y = x @ W.T (+ bias) for float32 x and a weight stored as 4-bit blocks (GGUF's Q4_0 / Q4_1: per group of
// 32 inputs, W = d q + m with q in 0..15 and float32 d, m), in float32 arithmetic on AMX's bf16 tiles.
//
// Why: a float32 model de-quantized from such a file (SmolLM2's GGUF is Q4_1) holds weights that are
// exactly d q + m (engine/layers/exact_blocks.py checks every one, bit for bit, at load), and a float32
// GEMM on AVX-512 FMAs streams 4 bytes per weight and is arithmetic-bound from ~16 rows. Here every product
// is exact and every sum is float32, as in an IEEE float32 GEMM: x is split into three bfloat16s,
// x = x0 + x1 + x2 exactly (24 significant bits in three 8-bit parts), q is an integer below 16 (exact in
// bf16), so each tile product xi q is exact in float32 and the tiles sum them in float32. Per group g of
// 32 inputs:
//     y[r, n] += d[g, n] * S[r, n] + m[g, n] * X[r, g],   S = sum over k in g of x[r, k] q[k, n] (tiles),
//                                                       X = sum over k in g of x[r, k] (float32)
// which is x W regrouped: the errors are float32 rounding of other sums, not of the weights (unlike
// float32_matmul_precision "high", which drops ~16 bits of each). Three bf16 tile products per weight, as
// "high"; the weight streams as 0.75 bytes per parameter (4-bit codes, float32 d and m per 32) instead of
// 4, and each pair and group's codes are widened to bf16 in L1 (a table lookup) before the tiles load them.
// A non-finite x value makes its row's outputs nan where IEEE float32 may give +-inf (inf - inf parts).
// As in every bf16 conversion and AMX product, subnormal x counts as zero, and below ~2^-110 x's third part
// (subnormal itself) is dropped: far below any activation.
//
// Layout (pack_amx_blocks): codes [NB / 2, G, 512] uint8, NB = N / 16 rounded up to even; per column-tile
// pair and group, the two AMX B operands (the pair's column tiles, 512 codes each) in VNNI order, two codes
// a byte: operand element e (row r = e / 32 holds, per column j, the pair (q[16 nb + j, 32 g + 2 r],
// q[16 nb + j, 32 g + 2 r + 1])) of the pair's 1024 is byte 32 (e / 64) + e % 32, its low nibble where
// e % 64 < 32, else its high one. scales [NB / 2, G, 2, 32] float32: per pair and group, d of the pair's 32
// columns, then m. Padding columns are zero.

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATCHINFER_AMX_BLOCKS 1
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kGroup = 32;          // inputs per block group: one tile step of k
constexpr int64_t kPairCols = 32;       // output columns per column-tile pair
constexpr int64_t kTileElems = 16 * 32;    // bf16 per B operand
constexpr int64_t kCodeBytes = kTileElems;  // bytes of a pair and group's 2 x 512 codes, two a byte
constexpr int64_t kRowTile = 16;        // rows of x per accumulator tile
constexpr int64_t kParts = 3;           // bf16 parts of a float32
// Items (pair, group) ahead whose codes and scales the walk prefetches into L2 (the widening waits on
// memory otherwise; into L1, T0, measured no better).
constexpr int64_t kPrefetchGroups = 2;
// Column-tile pairs a thread walks group by group together (the walk in amx_block_linear): 4 ran a SmolLM2
// step's 120 layer GEMMs 1.16-1.27x faster than 1 (pair by pair) at 1-96 rows; 8 no better than 4.
constexpr int64_t kBlockPairs = 4;
// Rows per chunk of that walk (a multiple of 32): each chunk walks the block's groups again (SmolLM2's
// layer GEMMs at 2048 rows: 1.45x the panel GEMM with 128, 1.44x with 256, 1.38x with 512, 1.16x unchunked;
// 96-512 rows alike).
constexpr int64_t kChunkRows = 128;

#if defined(BATCHINFER_AMX_BLOCKS)

// x [M, K] float32 -> parts [G, 3, Mp, 32] bf16 with x = x0 + x1 + x2 exactly (for normal x above ~2^-110:
// the conversions treat subnormals as zero), and sums [Mp, G] float32 (the 32-input group sums). Rows M..
// of both are the caller's (zeroed).
void split_exact(const float* x, int64_t M, int64_t K, int64_t Mp, bf16* parts, float* sums) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        __m512 total = _mm512_setzero_ps();
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t k = g * kGroup + half * 16;
          __m512 rest = _mm512_loadu_ps(x + r * K + k);
          total = _mm512_add_ps(total, rest);
          for (int64_t part = 0; part < kParts; ++part) {
            const __m256bh h = _mm512_cvtneps_pbh(rest);
            const __m512 widened = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
            rest = _mm512_sub_ps(rest, widened);  // exact: the bits below h's 8
            // [G, 3, Mp, 32]: a tile's 16 rows of a group's part are 1 KiB in a row
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts + ((g * kParts + part) * Mp + r) * kGroup +
                                                           half * 16),
                                reinterpret_cast<const __m256i&>(h));
          }
        }
        sums[r * G + g] = _mm512_reduce_add_ps(total);
      }
    }
  });
}

// One group of a 16-row tile against a column-tile pair (B operands in tmm6, tmm7): S = x q into s [16, 32]
// float32 through accumulators tmm0-1; the small parts first. A macro: GCC's tile intrinsics take the tile
// number as a literal.
#define BATCHINFER_GROUP_TILE(x, part_stride, ldx_bytes, s)            \
  do {                                                                 \
    _tile_zero(0);                                                     \
    _tile_zero(1);                                                     \
    _tile_loadd(4, (x) + 2 * (part_stride), ldx_bytes);                \
    _tile_dpbf16ps(0, 4, 6);                                           \
    _tile_dpbf16ps(1, 4, 7);                                           \
    _tile_loadd(5, (x) + (part_stride), ldx_bytes);                    \
    _tile_dpbf16ps(0, 5, 6);                                           \
    _tile_dpbf16ps(1, 5, 7);                                           \
    _tile_loadd(4, x, ldx_bytes);                                      \
    _tile_dpbf16ps(0, 4, 6);                                           \
    _tile_dpbf16ps(1, 4, 7);                                           \
    _tile_stored(0, s, kPairCols * sizeof(float));                     \
    _tile_stored(1, (s) + 16, kPairCols * sizeof(float));              \
  } while (0)

// The same for two 16-row tiles at once (x, x + 16 rows; s [32, 32]): four independent accumulators
// (tmm0-3), each x tile load feeding two products.
#define BATCHINFER_GROUP_TILE_PAIR(x, row16, part_stride, ldx_bytes, s)  \
  do {                                                                 \
    _tile_zero(0);                                                     \
    _tile_zero(1);                                                     \
    _tile_zero(2);                                                     \
    _tile_zero(3);                                                     \
    for (int part = 2; part >= 0; --part) {                            \
      _tile_loadd(4, (x) + part * (part_stride), ldx_bytes);           \
      _tile_loadd(5, (x) + part * (part_stride) + (row16), ldx_bytes); \
      _tile_dpbf16ps(0, 4, 6);                                         \
      _tile_dpbf16ps(1, 4, 7);                                         \
      _tile_dpbf16ps(2, 5, 6);                                         \
      _tile_dpbf16ps(3, 5, 7);                                         \
    }                                                                  \
    _tile_stored(0, s, kPairCols * sizeof(float));                     \
    _tile_stored(1, (s) + 16, kPairCols * sizeof(float));              \
    _tile_stored(2, (s) + 16 * kPairCols, kPairCols * sizeof(float));  \
    _tile_stored(3, (s) + 16 * kPairCols + 16, kPairCols * sizeof(float)); \
  } while (0)

// A pair and group's 1024 codes (512 bytes, two a byte) -> its two B operands as bf16: each code looked up
// in a 32-entry table of bf16(0..15), one vpermw per 32 codes.
inline void widen_codes(const uint8_t* codes, bf16* out) {
  alignas(64) static const uint16_t table[32] = {
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170};  // bf16(i): float i's high half; 16.. unused
  const __m512i lookup = _mm512_load_si512(table);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < kCodeBytes / 32; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c));
    const __m256i lo = _mm256_and_si256(bytes, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    _mm512_store_si512(out + 64 * c, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), lookup));
    _mm512_store_si512(out + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(hi), lookup));
  }
}

// acc[r] += d S[r] + X[r] m over a tile's valid rows (acc and s rows are 32 floats).
inline void scale_group(float* acc, const float* s, const float* sums, int64_t G, int64_t rows,
                        const float* scale) {
  const __m512 d0 = _mm512_loadu_ps(scale), d1 = _mm512_loadu_ps(scale + 16);
  const __m512 m0 = _mm512_loadu_ps(scale + 32), m1 = _mm512_loadu_ps(scale + 48);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 total = _mm512_set1_ps(sums[r * G]);
    float* a = acc + r * kPairCols;
    const float* sr = s + r * kPairCols;
    __m512 lo = _mm512_fmadd_ps(_mm512_loadu_ps(sr), d0, _mm512_loadu_ps(a));
    __m512 hi = _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16), d1, _mm512_loadu_ps(a + 16));
    _mm512_storeu_ps(a, _mm512_fmadd_ps(total, m0, lo));
    _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(total, m1, hi));
  }
}

#endif

}  // namespace

std::vector<torch::Tensor> pack_amx_blocks(torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.size(1) % kGroup == 0,
              "pack_amx_blocks: q a uint8 [N, K] of codes, K a multiple of 32");
  const int64_t N = q.size(0), K = q.size(1), G = K / kGroup;
  TORCH_CHECK(d.sizes() == at::IntArrayRef({N, G}) && m.sizes() == at::IntArrayRef({N, G}),
              "pack_amx_blocks: d and m [N, K / 32]");
  const int64_t pairs = (N + kPairCols - 1) / kPairCols, Np = pairs * kPairCols;
  torch::Tensor codes = torch::zeros({Np, K}, q.options());
  codes.narrow(0, 0, N).copy_(q);
  // [Np, K] -> [pairs, 2 tiles, 16 cols, G, 16 k pairs, 2] -> [pairs, G, 2 tiles, 16 k pairs, 16 cols, 2]
  codes = codes.view({pairs, 2, 16, G, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous()
              .view({pairs, G, kCodeBytes / 32, 2, 32});
  // two codes a byte: byte j of each 32-byte chunk c holds code 64 c + j (low nibble) and 64 c + 32 + j
  codes = codes.select(3, 0).bitwise_or(codes.select(3, 1).bitwise_left_shift(4))
              .reshape({pairs, G, kCodeBytes});
  torch::Tensor scales = torch::zeros({2, Np, G}, d.options().dtype(at::kFloat));
  scales[0].narrow(0, 0, N).copy_(d);
  scales[1].narrow(0, 0, N).copy_(m);
  // [2, pairs, 32, G] -> [pairs, G, 2, 32]
  scales = scales.view({2, pairs, kPairCols, G}).permute({1, 3, 0, 2}).contiguous();
  return {codes, scales};
}

torch::Tensor amx_block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               c10::optional<torch::Tensor> bias, int64_t out_features) {
#if defined(BATCHINFER_AMX_BLOCKS)
  TORCH_CHECK(request_amx_tiles(), "amx_block_linear: the kernel refused AMX's tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "amx_block_linear: x a float32 [M, K] CPU tensor");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kCodeBytes && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              "amx_block_linear: codes [NB / 2, G, 512] uint8 from pack_amx_blocks");
  const int64_t M = x.size(0), K = x.size(1), pairs = codes.size(0), G = codes.size(1), N = out_features;
  TORCH_CHECK(K == G * kGroup, "amx_block_linear: x's K is not the codes' 32 * G");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({pairs, G, 2, kPairCols}) &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "amx_block_linear: scales [NB / 2, G, 2, 32] float32 from pack_amx_blocks");
  TORCH_CHECK(N > (pairs - 1) * kPairCols && N <= pairs * kPairCols, "amx_block_linear: out_features");
  torch::Tensor bf;
  if (bias.has_value() && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == N, "amx_block_linear: bias of out_features values");
    bf = bias->to(at::kFloat).contiguous();
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t Mp = (M + kRowTile - 1) / kRowTile * kRowTile, row_tiles = Mp / kRowTile;
  torch::Tensor parts = torch::empty({G, kParts, Mp, kGroup}, x.options().dtype(at::kBFloat16));
  torch::Tensor sums = torch::zeros({Mp, G}, x.options());
  if (Mp > M) parts.narrow(2, M, Mp - M).zero_();
  const torch::Tensor xc = x.contiguous();
  bf16* xp = parts.data_ptr<at::BFloat16>();
  float* sp = sums.data_ptr<float>();
  split_exact(xc.data_ptr<float>(), M, K, Mp, xp, sp);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* scp = scales.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx_bytes = kGroup * int64_t(sizeof(bf16)), part_stride = Mp * kGroup;
  // Each thread takes a contiguous run of column-tile pairs (its weights) and walks their groups once,
  // every row tile against each group while its two B operands sit in the tiles.
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    configure_amx_tiles();
    const int64_t block_pairs = std::min<int64_t>(kBlockPairs, p1 - p0);
    const int64_t chunk_rows = std::min(kChunkRows, Mp);
    std::vector<float> acc_buffer(block_pairs * chunk_rows * kPairCols + 16);
    float* acc_base =
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc_buffer.data()) + 63) & ~uintptr_t(63));
    alignas(64) float s[2 * kRowTile * kPairCols];
    alignas(64) bf16 b[2 * kTileElems];  // the current pair and group's two B operands, widened
    // Pairs in blocks, rows in chunks; per block and chunk, the groups in order and every pair of the
    // block per group: a group's x parts (3 x 64 bytes per row) stay in L1 across the block's pairs
    // (walking one pair's groups at a time fetched each group's from L2 again for every pair: 1.16-1.27x
    // slower at 1-96 rows), and a chunk's sums and x parts stay in L2 (without chunks 2048 rows ran
    // 1.16x the panel GEMM, 512 rows 1.64x).
    for (int64_t pb = p0; pb < p1; pb += block_pairs) {
      const int64_t pe = std::min(p1, pb + block_pairs), count = pe - pb;
      for (int64_t c0 = 0; c0 < Mp; c0 += chunk_rows) {
        const int64_t c1 = std::min(Mp, c0 + chunk_rows), chunk = c1 - c0;
        std::fill(acc_base, acc_base + count * chunk * kPairCols, 0.0f);
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t p = pb; p < pe; ++p) {
            widen_codes(cp + (p * G + g) * kCodeBytes, b);
            const float* scale = scp + (p * G + g) * 2 * kPairCols;
            {  // the operands kPrefetchGroups items ahead in this walk (the block's next group past its end)
              const int64_t ahead = (p - pb) + kPrefetchGroups;
              const int64_t ap = pb + ahead % count, ag = g + ahead / count;
              if (ag < G) {
                const auto* lines = reinterpret_cast<const char*>(cp + (ap * G + ag) * kCodeBytes);
                for (int64_t line = 0; line < kCodeBytes; line += 64) _mm_prefetch(lines + line, _MM_HINT_T1);
                const auto* scale_lines =
                    reinterpret_cast<const char*>(scp + (ap * G + ag) * 2 * kPairCols);
                for (int64_t line = 0; line < 2 * kPairCols * int64_t(sizeof(float)); line += 64)
                  _mm_prefetch(scale_lines + line, _MM_HINT_T1);
              }
            }
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + kTileElems, 64);
            float* acc = acc_base + (p - pb) * chunk * kPairCols;
            for (int64_t t = c0 / kRowTile; t < c1 / kRowTile; t += 2) {
              const bf16* x = xp + (g * kParts * Mp + t * kRowTile) * kGroup;
              if (t + 1 < c1 / kRowTile)
                BATCHINFER_GROUP_TILE_PAIR(x, kRowTile * kGroup, part_stride, ldx_bytes, s);
              else
                BATCHINFER_GROUP_TILE(x, part_stride, ldx_bytes, s);
              const int64_t rows = std::min(2 * kRowTile, M - t * kRowTile);
              scale_group(acc + (t * kRowTile - c0) * kPairCols, s, sp + t * kRowTile * G + g, G, rows,
                          scale);
            }
          }
        }
        for (int64_t p = pb; p < pe; ++p) {
          const float* acc = acc_base + (p - pb) * chunk * kPairCols;
          const int64_t n0 = p * kPairCols, columns = std::min<int64_t>(kPairCols, N - n0);
          store_block_rows(acc, kPairCols, std::min(c1, M) - c0, columns, bp ? bp + n0 : nullptr,
                           yp + c0 * N + n0, N);
        }
      }
    }
    _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "amx_block_linear: this build has no AMX bf16 (amx_gemm_built() is false)");
  return {};
#endif
}
