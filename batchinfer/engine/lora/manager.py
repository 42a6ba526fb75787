"""LoRAManager: the adapters a model runner keeps loaded and the LoRABatch of each step.

At most max_cpu_loras adapters stay loaded (least recently used evicted); an evicted adapter that a
request still runs under is read again from its directory when a step needs it. The scheduler keeps the
adapters of one step within max_loras <= max_cpu_loras, so building a step never evicts one of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from cachetools import LRUCache
from torch import nn

from batchinfer.engine.lora.adapter import TARGET_MODULES, LoRAAdapter, LoRAError, load_adapter
from batchinfer.engine.lora.layers import LoRABatch, StackCache, build_lora_batch
from batchinfer.engine.lora.request import LoRARequest
from batchinfer.engine.parallel.distributed import tp_rank, tp_world_size
from batchinfer.engine.worker.runner_protocol import ScheduledSequence

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

ENGINE_MODULES = frozenset(module for module, _ in TARGET_MODULES.values())


class LoRAManager:
    """Loads adapters on first use into an LRU of max_cpu_loras; builds each step's LoRABatch."""

    def __init__(
        self, hf_config: PretrainedConfig, *, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.loaded: LRUCache[int, LoRAAdapter] = LRUCache(maxsize=max_cpu_loras)
        self._identities: dict[int, tuple[str, str]] = {}  # lora_int_id -> (name, path) first seen
        self.num_loads = 0
        self.stacks = StackCache() if device.type == "cuda" and _triton_available() else None

    def attach(self, model: nn.Module) -> int:
        """Mark the model's adaptable linear layers with their adapter key; returns how many."""
        count = 0
        for name, module in model.named_modules():
            parts = name.split(".")
            if len(parts) >= 5 and parts[-1] in ENGINE_MODULES and parts[-4] == "layers":
                module.lora_key = f"layers.{parts[-3]}.{parts[-1]}"
                count += 1
        return count

    def add(self, request: LoRARequest) -> None:
        """Check a new request's adapter (loaded once, when its id is new); LoRAError if it cannot run here.

        An adapter checked before is not read again here, even if evicted since: a step reads it when it
        needs it, so queueing many adapters' requests does not churn the loaded set.
        """
        known = self._identities.get(request.lora_int_id)
        if known is None:
            self.get(request)
        elif known != (request.lora_name, request.lora_path):
            raise LoRAError("lora_request.lora_int_id", f"{request.lora_int_id} already names adapter "
                            f"{known[0]!r} ({known[1]}); give each adapter its own id")

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request`, read from its directory (and checked) unless it is loaded."""
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request.lora_name, request.lora_path, hf_config=self.hf_config,
                                   max_lora_rank=self.max_lora_rank, dtype=self.dtype, device=self.device,
                                   tp_rank=tp_rank(), tp_size=tp_world_size())  # this rank's share
            self.num_loads += 1
            self._identities[request.lora_int_id] = (request.lora_name, request.lora_path)
            self.loaded[request.lora_int_id] = adapter
            logger.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", request.lora_name,
                        request.lora_path, adapter.rank, adapter.num_bytes / 2**20)
        return adapter

    def batch_for(self, scheduled: Sequence[tuple[ScheduledSequence, int]]) -> LoRABatch | None:
        """The step's LoRABatch (None when no scheduled sequence runs under an adapter)."""
        requests = [getattr(seq, "lora_request", None) for seq, _ in scheduled]
        if not any(requests):
            return None
        adapters = [None if request is None else self.get(request) for request in requests]
        return build_lora_batch(adapters, [n for _, n in scheduled], self.device, self.stacks)


def _triton_available() -> bool:
    import batchinfer.kernels as kernels

    return kernels.TRITON_AVAILABLE
