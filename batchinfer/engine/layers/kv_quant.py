"""Quantized KV cache formats (EngineConfig.kv_cache_dtype): how a K/V row is stored and read back.

Why: on CPU, decode attention is memory-bound (cpu_attention.py); a cache of 1-byte codes reads half the
bytes of a bf16 cache and a quarter of fp32's, and holds 2-4x the tokens in the same budget.

Formats, each per (token, kv head) row of head_dim values:
- "bf16": bfloat16 values, no scale (a float32 model's cache at half the bytes).
- "fp8_e4m3": float8_e4m3fn values, scale = max|x| / 448 per (token, head): a static scale of 1.0 (vLLM's
  default) puts small K/V values among e4m3's subnormals (measured: 42% greedy agreement on the tiny test
  model), the per-row scale keeps every row at the full 3-bit mantissa.
- "int8": symmetric int8 codes, scale = max|x| / 127 per (token, head) (one float32 each).
- "u8": asymmetric uint8 codes, scale = (max - min) / 255 and zero point = min per (token, head), as
  OpenVINO's u8 KV cache.
The params tensor [num_blocks, block_size, Hkv, P] float32 sits beside the codes [.., Hkv, D] (P = 0, 1, 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.engine.kv_cache_dtypes import MODEL_DTYPE_KV_CACHES

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


@dataclass(frozen=True)
class KVCacheFormat:
    """One quantized cache format: its storage dtype and its per-(token, head) float32 params."""

    name: str
    storage: torch.dtype
    num_params: int  # 0: none, 1: scale, 2: scale and zero point

    def bytes_per_row(self, head_dim: int) -> int:
        """Bytes one (token, kv head) row takes: codes plus params."""
        return head_dim * self.storage.itemsize + 4 * self.num_params


FORMATS = {
    "bf16": KVCacheFormat("bf16", torch.bfloat16, 0),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn, 1),
    "int8": KVCacheFormat("int8", torch.int8, 1),
    "u8": KVCacheFormat("u8", torch.uint8, 2),
}


def kv_cache_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheFormat | None:
    """The format of a resolved kv_cache_dtype (EngineConfig.resolved_kv_cache_dtype); None when the cache
    simply holds the model dtype ("auto", "fp32" under float32, "bf16" under bfloat16). "fp32" under
    another model dtype is a ValueError naming the choices."""
    model = str(model_dtype).removeprefix("torch.")
    if kv_cache_dtype == "auto" or MODEL_DTYPE_KV_CACHES.get(kv_cache_dtype) == model:
        return None
    if kv_cache_dtype == "fp32":
        raise ValueError(f"kv_cache_dtype='fp32' is a float32 model's own cache; this model runs {model}: "
                         "use auto, bf16, int8, u8 or fp8_e4m3")
    return FORMATS[kv_cache_dtype]


def quantize(x: torch.Tensor, fmt: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, Hkv, D] -> (codes [N, Hkv, D] in fmt.storage, params [N, Hkv, P] float32 or None)."""
    if fmt.num_params == 0:
        return x.to(fmt.storage), None
    xf = x.float()
    if fmt.name == "fp8_e4m3":
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    if fmt.name == "int8":
        scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-8)
        codes = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
        return codes, scale
    low, high = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = ((high - low) / 255.0).clamp_min(1e-8)
    codes = torch.round((xf - low) / scale).clamp_(0, 255).to(torch.uint8)
    return codes, torch.cat([scale, low], -1)


def dequantize(codes: torch.Tensor, params: torch.Tensor | None, fmt: KVCacheFormat,
               dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] with params [..., P] -> values [..., D] in dtype (inverse of quantize)."""
    if params is None or fmt.num_params == 0:
        return codes.to(dtype)
    values = codes.float() * params[..., :1]
    if fmt.num_params == 2:
        values += params[..., 1:2]
    return values.to(dtype)
