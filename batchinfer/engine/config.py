"""EngineConfig: every knob of one engine instance, validated on construction.

Import-light: torch is imported only inside the helpers that resolve "auto" values.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

# EngineConfig.quantization values besides None: int8 weights (fbgemm, oneDNN's on AMX), or a GGUF model's
# own Q4_0 / Q4_1 / Q8_0 blocks; each format's loader, packer and kernel live in engine/layers/quantization.py
from batchinfer.engine.kv_cache_dtypes import (
    KV_CACHE_AUTO_CPU_QUANTIZED,
    MODEL_DTYPE_KV_CACHES,
    canonical_kv_cache_dtype,
)
from batchinfer.engine.layers.quantization import quantization_format, splitting_formats

# tests import cpu_has_native_bf16 from here too
from batchinfer.engine.native.cpu_features import CPU_LINEAR_ENV, cpu_has_amx_bf16, cpu_has_native_bf16
from batchinfer.engine.speculative_config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of a dtype (its --dtype choices); anything else is refused with the valid list.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
EXECUTOR_BACKENDS = ("mp", "ray")  # how the ranks of a parallel engine start: local processes, Ray actors
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def canonical_dtype(value: object) -> str:
    """`value` as one of DTYPES (vLLM's "half" / "float" accepted); ValueError naming the valid ones."""
    name = DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)} (or vLLM's half, float); got {value!r}")
    return name


def check_device(value: object) -> str:
    """`value` when it names a device batchinfer runs on; ValueError listing the valid forms otherwise."""
    if not isinstance(value, str) or not _DEVICE_PATTERN.match(value):
        raise ValueError(f"device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {value!r}")
    return value


def torch_is_cpu_only_build() -> bool:
    """True when the installed torch was built without CUDA or ROCm, read from its version.py without
    importing torch (~2 s); False when unsure, so the caller asks torch itself."""
    spec = importlib.util.find_spec("torch")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            text = (Path(location) / "version.py").read_text()
        except OSError:
            continue
        gpu_builds = re.findall(r"^(?:cuda|hip)\b[^=\n]*=\s*(.+)$", text, re.MULTILINE)
        return len(gpu_builds) == 2 and all(value.strip() == "None" for value in gpu_builds)
    return False


def require_device(device: str) -> None:
    """Raise DeviceUnavailableError when `device` is CUDA and this torch has no usable CUDA device."""
    if not device.startswith("cuda"):
        return
    import torch

    from batchinfer.engine.errors import DeviceUnavailableError

    if torch.version.cuda is None:
        raise DeviceUnavailableError(f"device {device!r}: this torch ({torch.__version__}) is a CPU build "
                                     "without CUDA; use --device cpu (or auto), or install a CUDA torch")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise DeviceUnavailableError(f"device {device!r}: {count} CUDA device(s) visible here; use "
                                     "--device cpu, or a cuda:N below that count")


# How float32 GEMMs run on a CPU with AMX bf16 tiles (torch.set_float32_matmul_precision's names):
# "highest": IEEE float32 (panel GEMM / oneDNN); "high": each float32 as the sum of two bf16s, three bf16
# products summed in float32 on AMX (layers/amx_linear.py has its error and speed); "auto": high for
# embeddings (judged by cosine: 1.000000 against IEEE on SmolLM2), highest for generation (token-exact with
# transformers as documented). Where no AMX kernel runs (no AMX, not float32, int8 / gguf weights, CUDA)
# every setting is "highest".
FLOAT32_MATMUL_PRECISIONS = ("auto", "highest", "high")


@dataclass
class EngineConfig:
    """Configuration of one engine: model, batching limits, KV cache size, device and dtype."""

    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None -> the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit override of the KV cache size in blocks
    kv_cache_memory_bytes: int = 1 << 30  # KV cache budget on CPU
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"  # auto = bfloat16 on CUDA and on CPUs with native bf16 (see resolved_dtype)
    # KV cache element type: "auto" (resolved_kv_cache_dtype) or KV_CACHE_DTYPES' formats (CPU only)
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # None, "int8" (int8 weights, dynamic GEMMs), "gguf" (a .gguf's blocks)
    # float32 GEMMs on AMX CPUs: FLOAT32_MATMUL_PRECISIONS (resolved_float32_matmul_precision)
    float32_matmul_precision: str = "auto"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"  # "auto", "torch", "triton"
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of layers (pp_runner.py); x tensor_parallel_size ranks in all
    distributed_executor_backend: str = "mp"  # EXECUTOR_BACKENDS; "ray" joins a running Ray cluster
    # CPU, one rank: lower the thread count while other work keeps some of our cores busy (threads.py).
    adaptive_threads: bool = True
    # Speculative decoding: None (off), a SpeculativeConfig, or its dict {"method": "ngram" | "draft_model",
    # ...} (speculative_config.py), which construction validates into a SpeculativeConfig, so errors name
    # speculative_config.<key>; after construction it is always a SpeculativeConfig or None.
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA (lora/): requests may run under PEFT adapters (lora_request); max_loras adapters in one
    # step, ranks up to max_lora_rank, max_cpu_loras adapters kept loaded (None: max_loras), LRU evicted.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Structured output (structured.py): compile threads (fair between owners), the time one constraint
    # may take to compile (its requests error past it), the bytes of compiled grammars kept.
    grammar_compile_workers: int = 2
    grammar_compile_timeout_s: float = 30.0
    compiled_grammar_cache_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model: must be a non-empty model name or path")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                     "pipeline_parallel_size", "grammar_compile_workers"):
            _require_int(name, getattr(self, name), minimum=1)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend: must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                             f"got {self.distributed_executor_backend!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), minimum=1)
        _require_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1)
        _require_int("seed", self.seed, minimum=None)
        if (
            not isinstance(self.gpu_memory_utilization, int | float)
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        self.dtype = canonical_dtype(self.dtype)
        check_device(self.device)
        quantization = quantization_format(self.quantization)
        if quantization.name is not None and self.device.startswith("cuda"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on CPU only; got device {self.device!r}"
            )
        self._check_kv_cache_dtype()
        if self.float32_matmul_precision not in FLOAT32_MATMUL_PRECISIONS:
            raise ValueError("float32_matmul_precision: must be one of "
                             f"{', '.join(FLOAT32_MATMUL_PRECISIONS)}; got {self.float32_matmul_precision!r}")
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if not quantization.splits_across_ranks and ranks > 1:
            raise ValueError(f"quantization={quantization.name!r} runs with tensor_parallel_size=1 and "
                             f"pipeline_parallel_size=1 only; use {splitting_formats()} to split it")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}; "
                f"got {self.attention_backend!r}"
            )
        for name in ("enable_prefix_caching", "enforce_eager", "adaptive_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false; got {getattr(self, name)!r}")
        self._check_lora()
        self.speculative_config = parse_speculative_config(self.speculative_config)  # the dict form too
        if self.speculative_config is not None and self.speculative_config.method == "draft_model" \
                and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config.method: draft_model runs with tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1 only (the n-gram method works at any size)")

    def _check_kv_cache_dtype(self) -> None:
        self.kv_cache_dtype = canonical_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype != "auto" and self.device.startswith("cuda"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} runs on CPU only (the Triton kernels "
                             f"read the model dtype); got device {self.device!r}")
        if self.kv_cache_dtype == "fp32" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"kv_cache_dtype='fp32' is a float32 model's own cache; got dtype "
                             f"{self.dtype!r}: use auto, bf16, int8, u8 or fp8_e4m3")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora: must be true or false; got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            _require_int(name, getattr(self, name), minimum=1)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _require_int("max_cpu_loras", self.max_cpu_loras, minimum=self.max_loras)
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters run with pipeline_parallel_size=1 only (tensor "
                             "parallelism works)")

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every configurable field (for error messages and CLI options)."""
        return [f.name for f in fields(cls)]

    def resolved_device(self) -> str:
        """The concrete device: "auto" becomes "cuda" when CUDA is available, else "cpu".

        An explicit CUDA device this process lacks is a DeviceUnavailableError (one line), not torch's
        assertion deep inside the model load.
        """
        if self.device != "auto":
            require_device(self.device)
            return self.device
        if torch_is_cpu_only_build():  # no torch import: a result-cache hit resolves its dtype without it
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> torch.dtype:
        """The concrete torch dtype: "auto" is bfloat16 on CUDA and on a CPU with native bf16 (float32 under
        int8 weights on CPU, resolved_dtype_name), else float32.

        On CPU bf16 pays only with native bf16 dot products (oneDNN's avx512_bf16 / AMX kernels: 1.5-2x the
        fp32 step on SmolLM2-135M, mean log-prob within 0.1% of fp32); emulated bf16 is slower than fp32.
        """
        import torch

        return getattr(torch, self.resolved_dtype_name())

    def resolved_kv_cache_dtype(self) -> str:
        """kv_cache_dtype with "auto" resolved: KV_CACHE_AUTO_CPU_QUANTIZED on CPU for a bfloat16 model or
        int8 weights, else "auto" (the model dtype: float32 stays token-exact with transformers, CUDA keeps
        its own cache); "fp32" / "bf16" under that very model dtype are "auto" too."""
        if MODEL_DTYPE_KV_CACHES.get(self.kv_cache_dtype) == self.resolved_dtype_name():
            return "auto"  # the model dtype's own cache: one result-cache key whichever way it was asked for
        if (self.kv_cache_dtype == "auto" and self.attention_backend != "triton"
                and (self.resolved_dtype_name() == "bfloat16" or self.quantization == "int8")
                and not self.resolved_device().startswith("cuda")):
            return KV_CACHE_AUTO_CPU_QUANTIZED
        return self.kv_cache_dtype

    def resolved_float32_matmul_precision(self) -> str:
        """float32_matmul_precision where the AMX kernel can run it (a float32 model with dense weights on a
        CPU with AMX bf16, not forced onto oneDNN's opaque layout by BATCHINFER_CPU_LINEAR), else "highest".
        """
        if (self.float32_matmul_precision == "highest" or self.resolved_dtype_name() != "float32"
                or self.quantization is not None or not cpu_has_amx_bf16()
                or os.environ.get(CPU_LINEAR_ENV) == "onednn" or self.resolved_device().startswith("cuda")):
            return "highest"
        return self.float32_matmul_precision

    def resolved_dtype_name(self) -> str:
        """resolved_dtype's name ("bfloat16", ...): torch is imported only to resolve device "auto".

        int8 weights on CPU take float32 activations: their GEMMs read and write float32, so bf16 activations
        only add a conversion each way per GEMM (1.11-1.12x slower on SmolLM2 over a u8 cache, AMX CPU).
        """
        if self.dtype == "auto":
            if self.resolved_device().startswith("cuda"):
                return "bfloat16"
            return "bfloat16" if cpu_has_native_bf16() and self.quantization != "int8" else "float32"
        return self.dtype


def _require_int(name: str, value: object, *, minimum: int | None) -> None:
    # bool is an int subclass; True as a batch size is a mistake, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer; got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}; got {value}")
