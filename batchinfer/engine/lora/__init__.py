"""Multi-LoRA: PEFT adapters over the base model, many adapters batched together in one engine step.

request.py   LoRARequest (vLLM's): which adapter a request runs under
adapter.py   a PEFT adapter directory -> weights in the engine's fused layouts (checked at load)
layers.py    the step's adapter segments and the batched LoRA product added to a linear layer's output
manager.py   the adapters kept loaded (LRU of max_cpu_loras) and the step's LoRABatch
"""

from __future__ import annotations

from batchinfer.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
