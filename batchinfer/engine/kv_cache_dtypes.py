"""The KV cache element types a user names (kv_cache_dtype) and the rules on their names alone.

Import-free (no torch, nothing of ours): engine/config.py resolves "auto" with them and layers/kv_quant.py
maps them to formats, so neither imports the other for them.
"""

from __future__ import annotations

# "auto": KV_CACHE_AUTO_CPU_QUANTIZED on CPU under a bfloat16 model or int8 weights, else the model dtype;
# "fp32": a float32 model's own cache (int8 weights' cache before auto became u8); the others are
# kv_quant.FORMATS (int8: per token and head scale; u8: scale and zero point)
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp8_e4m3", "int8", "u8")
# the kv_cache_dtype values that name a model dtype's own cache (unquantized): value -> that dtype's name
MODEL_DTYPE_KV_CACHES = {"fp32": "float32", "bf16": "bfloat16"}
# What "auto" is on CPU for a bfloat16 model or int8 weights (issue 34), OpenVINO's CPU default too. bf16
# model: 0.99-1.25x the bf16 cache's tok/s on SmolLM2 (more the longer the contexts) with the native kernels,
# 1.78x the tokens in the same memory (head_dim 64), at 0.18% of a fixed text's mean log-probability
# (bench/quality.py). int8 weights (float32 activations): 1.17x the float32 cache's tok/s on an AMX CPU.
# Resolved from the config alone, so every rank and the result-cache key agree (without the native kernels
# the torch path reads it, slower).
KV_CACHE_AUTO_CPU_QUANTIZED = "u8"


def canonical_kv_cache_dtype(value: str) -> str:
    """`value` as one of KV_CACHE_DTYPES ("uint8" accepted for u8); ValueError naming the valid ones."""
    name = "u8" if value == "uint8" else value
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}; got {value!r}")
    return name
