"""Native CPU decode attention over the paged KV cache, and the loader of the CPU kernels' extension.

The C++ lives in csrc/ (paged_attention.cpp here; fused_ops.cpp and gguf_linear.cpp for the layers).

Why: on CPU, decode attention is memory-bound. The pure-torch path gathers each sequence's blocks into a
padded batch (read + write) and SDPA reads that copy again; this kernel reads every cached K/V row once,
straight from the blocks (AVX-512 (+avx512_bf16 dot products) or AVX2/FMA for head_dim 64 and 128,
portable loops otherwise; `set_isa` caps the path for A/B runs): ~15x faster than
the gather + SDPA path per layer at 128 sequences of ~170 tokens on 2 cores (2.3 ms vs 34 ms). It handles
decode tokens (one query per sequence, the bulk of the steps); prefill chunks keep the SDPA path, whose
GEMMs suit many queries per sequence. float32 and bfloat16 caches (NATIVE_DTYPES); a bf16 row is widened
to float32 in registers, and scores, softmax and sums stay float32. A quantized cache of int8 / u8 codes
(kv_quant.py; QUANTIZED_CODES) is read by paged_decode_attention_quantized, dequantized in registers.

Built with torch.utils.cpp_extension (g++, ninja) by native_build.py: once per installation and cache
key (sources, torch, Python, flags, CPU), at install by `batchinfer build-kernels`, else on first use with
a visible line on stderr. If the build fails, or BATCHINFER_CPU_ATTENTION=sdpa is set, `load()` returns
None and the torch path is used: the same computation in other float sums, slower.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from batchinfer.engine.native import build as native_build
from batchinfer.engine.native.build import BUILD_WAIT_S, NativeBuild

logger = logging.getLogger(__name__)

_extension: Any = None
_attempted = False

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # the element types the kernel reads and writes
QUANTIZED_CODES = (torch.int8, torch.uint8)  # code dtypes of the quantized caches the kernel reads
ISAS = ("auto", "generic", "avx2", "avx512", "avx512_bf16")  # set_isa's choices (auto: the best built)

CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # -march=native: the CPU tag is in the key
LDFLAGS = ["-fopenmp"]
build_info: NativeBuild | None = None  # how load() got the extension (where it lives, built or cached)


def extension_name() -> str:
    """The extension's module name: one per cache key (sources, torch, Python, flags, CPU)."""
    return f"batchinfer_cpu_kernels_{native_build.cache_key(native_build.source_text(), CFLAGS, LDFLAGS)}"


def load(*, wait_s: float = BUILD_WAIT_S) -> Any:
    """The compiled extension (built on the first call), or None when it is disabled or cannot be built.

    Waits at most `wait_s` for another process building it (native_build.build_lock), logging meanwhile.
    """
    global _extension, _attempted, build_info
    if _attempted:
        return _extension
    _attempted = True
    if os.environ.get("BATCHINFER_CPU_ATTENTION", "native") == "sdpa":
        return None
    try:
        build_info = native_build.load_or_build(name=extension_name(), cflags=CFLAGS, ldflags=LDFLAGS,
                                                wait_s=wait_s)
        _extension = build_info.module if build_info is not None else None
    except Exception as exc:  # no compiler / ninja: the SDPA path is correct, only slower
        logger.warning("native CPU decode attention unavailable (%s); using the SDPA path", exc)
        _extension = None
    return _extension


FUSED_ENV = "BATCHINFER_CPU_FUSED"  # "0": the layers run their torch ops instead (A/B runs)
_FUSED_OFF = os.environ.get(FUSED_ENV, "1") == "0"


def fused_ops_for(x: torch.Tensor) -> Any:
    """The extension's fused ops (rotary_, silu_and_mul) for x, or None.

    None unless x is a float32/bf16 CPU tensor outside autograd (the ops record no gradient) and the
    extension is enabled and built; the layers then run their torch ops.
    """
    if _FUSED_OFF or x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES or torch.is_grad_enabled():
        return None
    return load()


def supports(dtype: torch.dtype) -> bool:
    """True when the kernel handles a cache of this dtype and could be built (load() is not None)."""
    return dtype in NATIVE_DTYPES and load() is not None


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """out[s] = attention of q[s] (at position seq_lens[s] - 1) over its first seq_lens[s] cached keys."""
    _extension.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale)
    return out


def paged_decode_attention_quantized(
    out: torch.Tensor,
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_params: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_decode_attention over int8/u8 codes [NB, BS, Hkv, D] with float32 params [NB, BS, Hkv, P]."""
    _extension.paged_decode_attention_quantized(out, q, k_codes, v_codes, k_params, v_params, block_tables,
                                                seq_lens, scale)
    return out


def supports_quantized(codes: torch.dtype, dtype: torch.dtype) -> bool:
    """True when the kernel reads codes of this dtype for queries of dtype (and the extension is built)."""
    ext = load() if codes in QUANTIZED_CODES and dtype in NATIVE_DTYPES else None
    return ext is not None and hasattr(ext, "paged_decode_attention_quantized")


def set_isa(name: str) -> str:
    """Cap the kernels' path (one of ISAS) in this process; returns the path taken (<= the best built)."""
    if name not in ISAS:
        raise ValueError(f"unknown decode attention path {name!r}: one of {', '.join(ISAS)}")
    ext = load()
    if ext is None:
        raise RuntimeError("the native CPU kernels are not available")
    return str(ext.set_decode_attention_isa(name))
