"""EngineConfig: every knob of one engine instance, validated on construction.

Import-light: torch is imported only inside the helpers that resolve "auto" values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


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
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"  # "auto", "torch", "triton"
    seed: int = 0
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model: must be a non-empty model name or path")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            _require_int(name, getattr(self, name), minimum=1)
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
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.match(self.device):
            raise ValueError(f"device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}; "
                f"got {self.attention_backend!r}"
            )
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false; got {getattr(self, name)!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every configurable field (for error messages and CLI options)."""
        return [f.name for f in fields(cls)]

    def resolved_device(self) -> str:
        """The concrete device: "auto" becomes "cuda" when CUDA is available, else "cpu"."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> torch.dtype:
        """The concrete torch dtype: "auto" is float32 on CPU and bfloat16 on CUDA."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


def _require_int(name: str, value: object, *, minimum: int | None) -> None:
    # bool is an int subclass; True as a batch size is a mistake, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer; got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}; got {value}")
