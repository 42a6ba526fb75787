"""Inference engine: continuous batching over a paged KV cache with prefix caching.

Import-light: nothing here imports torch until an engine class is actually used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# public name -> the module defining it, imported on first use (PEP 562)
_EXPORTS = {
    "CompletionOutput": "batchinfer.engine.outputs",
    "Engine": "batchinfer.engine.llm_engine",
    "EngineConfig": "batchinfer.engine.config",
    "EngineStats": "batchinfer.engine.metrics",
    "LLM": "batchinfer.engine.llm",
    "Logprob": "batchinfer.engine.outputs",
    "LoRARequest": "batchinfer.engine.lora.request",
    "ModelRunnerProtocol": "batchinfer.engine.worker.runner_protocol",
    "RequestOutput": "batchinfer.engine.outputs",
    "ResolvedModel": "batchinfer.engine.models.resolved_model",
    "SamplingParams": "batchinfer.engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'batchinfer.engine' has no attribute {name!r}")
