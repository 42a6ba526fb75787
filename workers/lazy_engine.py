"""LazyEngine: an Engine built on the first request that needs it, so a job served wholly from the result
cache completes without loading a model (`batchinfer run`, issue 31).

Until then it answers what a ShardRunner asks of an idle engine (nothing unfinished, no progress, aborts
are no-ops, a step returns nothing) and its `config`; the calls that need a model (tokenize, add_request,
embed) build the engine, once. A build that fails raises
EngineStartError (the cause chained), which `batchinfer run` turns into its job's failure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workers.metrics import WorkerMetrics

if TYPE_CHECKING:  # the real ones import torch: this module must not (a hit loads no engine)
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.llm_engine import Engine
    from batchinfer.engine.lora.request import LoRARequest
    from batchinfer.engine.outputs import RequestOutput
    from batchinfer.engine.sampling_params import SamplingParams


class EngineStartError(RuntimeError):
    """The engine could not be built when the first request needed it (the cause is chained)."""


class LazyEngine:
    """Stands in for an Engine until one is needed; see the module docstring."""

    def __init__(self, build: Callable[[], Engine], config: EngineConfig) -> None:
        self.config = config  # what the runner and the result cache read before any request runs
        self._build = build
        self._engine: Engine | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """True once the engine was built."""
        return self._engine is not None

    def get(self) -> Engine:
        """The engine, built now if it was not yet."""
        with self._lock:
            if self._engine is None:
                try:
                    self._engine = self._build()
                except Exception as exc:
                    raise EngineStartError(str(exc) or type(exc).__name__) from exc
                self.config = self._engine.config
            return self._engine

    def has_unfinished(self) -> bool:
        """Engine.has_unfinished; False before the engine exists."""
        return self._engine is not None and self._engine.has_unfinished()

    def get_num_unfinished(self) -> int:
        """Engine.get_num_unfinished; 0 before the engine exists."""
        return 0 if self._engine is None else self._engine.get_num_unfinished()

    def request_progress(self, request_id: str) -> tuple[int, int] | None:
        """Engine.request_progress; None (no such request) before the engine exists."""
        return None if self._engine is None else self._engine.request_progress(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Engine.abort; a no-op before the engine exists."""
        return None if self._engine is None else self._engine.abort(request_id)

    def worker_metrics(self) -> WorkerMetrics:
        """Worker metrics labelled like the engine will be (model label, first engine of the process)."""
        from batchinfer.engine.metrics import model_label

        return WorkerMetrics(
            model_name=model_label(self.config.model), engine="0",
            generated_tokens=lambda: 0 if self._engine is None else self._engine.recorder.generation_tokens,
            steps=lambda: 0 if self._engine is None else self._engine.recorder.num_steps)

    # What a ShardRunner calls once work arrives: each builds the engine on first use (no attribute proxy,
    # so the runner's needs stay listed here and a new one fails loudly in review, not at run time).
    @property
    def tokenizer(self) -> Any:  # the engine's transformers tokenizer: an untyped third-party object
        """The engine's tokenizer (builds the engine)."""
        return self.get().tokenizer

    def tokenize(self, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
        """Engine.tokenize (builds the engine)."""
        return self.get().tokenize(prompt, add_special_tokens=add_special_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    add_special_tokens: bool = True, lora_request: LoRARequest | None = None) -> None:
        """Engine.add_request (builds the engine)."""
        self.get().add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                               arrival_time=arrival_time, add_special_tokens=add_special_tokens,
                               lora_request=lora_request)

    def embed(self, inputs: list[str | list[int]], *, first_index: int = 0
              ) -> tuple[list[list[float]], int]:
        """Engine.embed (builds the engine)."""
        return self.get().embed(inputs, first_index=first_index)

    def step(self) -> list[RequestOutput]:
        """Engine.step; nothing to do before the engine exists."""
        return [] if self._engine is None else self._engine.step()
