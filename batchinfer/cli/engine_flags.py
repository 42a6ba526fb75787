"""The engine flags `batchinfer run` and `batchinfer worker` share, and the EngineConfig overrides they give.

A flag left out keeps the setting's value (Settings.engine_kwargs); one given overrides it for this process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import click

from batchinfer.engine.config import FLOAT32_MATMUL_PRECISIONS
from batchinfer.engine.kv_cache_dtypes import KV_CACHE_DTYPES
from batchinfer.engine_kwargs import EngineKwargs

_Command = TypeVar("_Command", bound=Callable[..., object])


def kv_cache_dtype_option(command: _Command) -> _Command:
    """Add --kv-cache-dtype (a value outside the choices: click's one-line usage error naming them)."""
    return click.option(
        "--kv-cache-dtype", type=click.Choice(list(KV_CACHE_DTYPES)), default=None,
        help="KV cache element type: auto (u8 under a bfloat16 model or int8 weights on CPU, else the "
             "model's dtype), or on CPU fp32 (float32 models), bf16, fp8_e4m3, int8 or u8 (default: "
             "settings.kv_cache_dtype).")(command)


def float32_matmul_precision_option(command: _Command) -> _Command:
    """Add --float32-matmul-precision (auto, highest, high)."""
    return click.option(
        "--float32-matmul-precision", type=click.Choice(list(FLOAT32_MATMUL_PRECISIONS)), default=None,
        help="float32 models (--dtype float32) on a CPU with AMX: highest (IEEE float32 GEMMs), high (bf16x3 "
             "on AMX tiles: errors ~5e-6 of an output's scale, the GEMMs 1.2-1.9x faster from 16 rows) or "
             "auto (high for embeddings, highest for generation; default: "
             "settings.float32_matmul_precision).")(command)


def engine_overrides(*, device: str | None = None, dtype: str | None = None,
                     kv_cache_dtype: str | None = None, quantization: str | None = None,
                     float32_matmul_precision: str | None = None,
                     max_model_len: int | None = None,
                     tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                     distributed_executor_backend: str | None = None) -> EngineKwargs:
    """The engine flags given on the command line (None: not given) as EngineConfig overrides."""
    given = {"device": device, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "quantization": quantization,
             "float32_matmul_precision": float32_matmul_precision,
             "max_model_len": max_model_len, "tensor_parallel_size": tensor_parallel_size,
             "pipeline_parallel_size": pipeline_parallel_size,
             "distributed_executor_backend": distributed_executor_backend}
    # cast: each parameter has its EngineKwargs field's type; the checker cannot follow the comprehension
    return cast(EngineKwargs, {name: value for name, value in given.items() if value is not None})
