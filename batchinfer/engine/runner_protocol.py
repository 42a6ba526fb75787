"""ModelRunnerProtocol: what the Engine needs of a model runner (one rank, or tensor-parallel ranks).

ModelRunner (model_runner.py) and TensorParallelRunner (tp_runner.py) both satisfy it, so the Engine
never looks past these members. Import-light: torch is named for type checkers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class ModelRunnerProtocol(Protocol):
    """Runs scheduled steps over a KV cache of num_kv_blocks blocks on `device`."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache (the same block ids on every rank)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the logits come back (the sampler works there)."""
        ...

    def execute_model(
        self, scheduled: Sequence[tuple[Any, int]], logits_counts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Run one step of (sequence, new tokens); float32 logits [sum(logits_counts), vocab].

        logits_counts[i]: the logits of entry i's last c scheduled tokens (default 1 each), entry by entry.
        """
        ...

    def close(self) -> None:
        """Release what outlives a step (worker processes); idempotent."""
        ...
