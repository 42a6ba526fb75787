"""Inference engine: continuous batching over a paged KV cache with prefix caching.

Import-light: nothing here imports torch until an engine class is actually used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the exports' types for checkers; at run time each is imported on first use
    from batchinfer.engine.config import EngineConfig as EngineConfig
    from batchinfer.engine.llm import LLM as LLM
    from batchinfer.engine.llm_engine import Engine as Engine
    from batchinfer.engine.lora.request import LoRARequest as LoRARequest
    from batchinfer.engine.metrics import EngineStats as EngineStats
    from batchinfer.engine.models.resolved_model import ResolvedModel as ResolvedModel
    from batchinfer.engine.outputs import CompletionOutput as CompletionOutput
    from batchinfer.engine.outputs import Logprob as Logprob
    from batchinfer.engine.outputs import RequestOutput as RequestOutput
    from batchinfer.engine.sampling_params import SamplingParams as SamplingParams
    from batchinfer.engine.worker.runner_protocol import ModelRunnerProtocol as ModelRunnerProtocol

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


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'batchinfer.engine' has no attribute {name!r}")
