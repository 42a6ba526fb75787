// AMX tile state shared by the kernels that run on AMX tiles (amx_gemm.cpp, amx_block_gemm.cpp); included
// only where the build has AMX (__AMX_TILE__).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
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
