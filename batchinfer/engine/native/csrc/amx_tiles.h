// What the kernels that run on AMX tiles share (amx_gemm.cpp, amx_block_gemm.cpp): the tile state and the
// store of a block's results; included only where the build has AMX (__AMX_TILE__).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <mutex>

// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA),
// once per process; torch's oneDNN asks for it too, but not before its first AMX primitive.
inline bool request_amx_tiles() {
  static std::once_flag once;
  static bool granted = false;
  std::call_once(once, [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return granted;
}

struct alignas(64) AmxTileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows of 64 bytes (each kernel says what each holds).
inline void configure_amx_tiles() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// rows x columns of a block's float32 results (row stride ld_src) into y (row stride ldy), plus bias (its
// columns' values, or nullptr).
inline void store_block_rows(const float* src, int64_t ld_src, int64_t rows, int64_t columns,
                             const float* bias, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = y + r * ldy;
    const float* row = src + r * ld_src;
    if (bias != nullptr)
      for (int64_t j = 0; j < columns; ++j) dst[j] = row[j] + bias[j];
    else
      std::memcpy(dst, row, columns * sizeof(float));
  }
}
