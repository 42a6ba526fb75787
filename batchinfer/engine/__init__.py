"""Inference engine: continuous batching over a paged KV cache with prefix caching.

Import-light: nothing here imports torch until an engine class is actually used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CompletionOutput": "batchinfer.engine.llm_engine",
    "Engine": "batchinfer.engine.llm_engine",
    "EngineConfig": "batchinfer.engine.config",
    "EngineStats": "batchinfer.engine.llm_engine",
    "LLM": "batchinfer.engine.llm_engine",
    "RequestOutput": "batchinfer.engine.llm_engine",
    "SamplingParams": "batchinfer.engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'batchinfer.engine' has no attribute {name!r}")
