"""The per-step attention context: batch layout tensors the model runner builds once per step and every
attention layer reads (set before the forward, reset after), so the model's forward signature stays
(input_ids, positions) as in a plain transformer. Beside it, the step's float32 matmul precision
(float32_matmul_high), which the linear layers read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchinfer.engine.layers.attention_plan import DenseGroup, TorchAttentionPlan
    from batchinfer.engine.lora.layers import LoRABatch


@dataclass
class AttentionContext:
    """Batch layout of one step, T packed new tokens of S sequences (ARCHITECTURE.md, contract 3).

    slot_mapping  [T] int64   cache slot of each new token (block_id * block_size + offset), -1 = skip
    cu_seqlens_q  [S+1] int32 sequence s owns packed tokens cu_seqlens_q[s] : cu_seqlens_q[s+1]
    seq_lens      [S] int32   context of s after this step (cached + new tokens)
    block_tables  [S, B] int32 physical blocks of s, padded with -1
    lora          the adapter segments of the packed tokens (None: every token runs the base model)
    dense_groups  backend "dense" (cache-free embeddings forward): the packed inputs' causal SDPA groups
                  (None: the tokens are one input)
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str  # "torch", "triton" or "dense" (no KV cache: embeddings)
    torch_plan: TorchAttentionPlan | None = None  # gather/mask plan of the torch backend
    lora: LoRABatch | None = None  # per active adapter its token rows (lora/layers.py); None: no LoRA work
    dense_groups: list[DenseGroup] | None = None  # backend "dense" only


_CONTEXT: AttentionContext | None = None
_FLOAT32_MATMUL_HIGH = False  # the running forward's linears run their bf16x3 kernel (LinearBase.packed_high)


def set_context(context: AttentionContext | None) -> None:
    """Install the layout of the step about to run (None clears it)."""
    global _CONTEXT
    _CONTEXT = context


def current_lora_batch() -> LoRABatch | None:
    """The running step's LoRA layout (None outside a step or when no token runs under an adapter)."""
    return None if _CONTEXT is None else _CONTEXT.lora


def get_context() -> AttentionContext:
    """The layout of the running step; attention layers call this."""
    if _CONTEXT is None:
        raise RuntimeError("no attention context set: run the model through ModelRunner.execute_model")
    return _CONTEXT


@contextmanager
def float32_matmul_high() -> Iterator[None]:
    """Run the block's forwards with float32_matmul_precision "high" (ModelRunner.embed under "auto")."""
    global _FLOAT32_MATMUL_HIGH
    previous, _FLOAT32_MATMUL_HIGH = _FLOAT32_MATMUL_HIGH, True
    try:
        yield
    finally:
        _FLOAT32_MATMUL_HIGH = previous


def float32_matmul_is_high() -> bool:
    """True inside float32_matmul_high: a linear with a bf16x3 kernel runs it."""
    return _FLOAT32_MATMUL_HIGH
