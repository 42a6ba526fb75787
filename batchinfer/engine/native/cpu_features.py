"""What this CPU can do, read once from /proc/cpuinfo: the flags that pick dtypes, kernels and build keys.

Import-free (no torch, nothing of ours): engine/config.py resolves "auto" dtypes with it, and the layers
(int8's GEMM range, the native build's cache key) read it without importing the config.
"""

from __future__ import annotations

import functools

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 dot products
VNNI_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products summed into int32, no overflow
# what csrc/amx_gemm.cpp's float32 GEMM on bf16 tiles (bf16x3) needs: AMX tiles, their bf16 products, and
# AVX-512 bf16 conversions for splitting x
AMX_BF16_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
# The CPU GEMM override (engine/layers/weight_packing.py's CPU_LINEAR_MODES): here so that engine/config.py
# resolves what runs without importing torch
CPU_LINEAR_ENV = "BATCHINFER_CPU_LINEAR"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return frozenset(next((line for line in handle if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 dot products natively (a flag of NATIVE_BF16_CPU_FLAGS)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_CPU_FLAGS)


def cpu_has_vnni() -> bool:
    """True when int8 dot products sum straight into int32 here (VNNI); AVX2's int16 pair sums saturate."""
    return any(flag in cpu_flags() for flag in VNNI_CPU_FLAGS)


def cpu_has_amx_bf16() -> bool:
    """True when this CPU has AMX's bf16 tiles (AMX_BF16_CPU_FLAGS): float32 GEMMs may run bf16x3 there."""
    return cpu_flags() >= AMX_BF16_CPU_FLAGS
