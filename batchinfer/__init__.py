"""batchinfer: batch LLM inference.

vLLM's offline names at the top: `from batchinfer import LLM, SamplingParams`. They are imported on first
use (PEP 562: each name is the engine's own class, not a stand-in), so `batchinfer --help` and the API
never pay for torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module defining it
_EXPORTS = {
    "CompletionOutput": "batchinfer.engine.outputs",
    "EmbeddingOutput": "batchinfer.engine.outputs",
    "EmbeddingRequestOutput": "batchinfer.engine.outputs",
    "EngineConfig": "batchinfer.engine.config",
    "LLM": "batchinfer.engine.llm",
    "RequestOutput": "batchinfer.engine.outputs",
    "SamplingParams": "batchinfer.engine.sampling_params",
    "StructuredOutputsParams": "batchinfer.engine.sampling_params",
    "TextPrompt": "batchinfer.engine.llm",
    "TokensPrompt": "batchinfer.engine.llm",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

if TYPE_CHECKING:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.llm import LLM, TextPrompt, TokensPrompt
    from batchinfer.engine.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
    )
    from batchinfer.engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> object:  # the names above, imported on first use
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # imported once; later lookups never come here
        return value
    raise AttributeError(f"module 'batchinfer' has no attribute {name!r}")
