"""The per-step attention context: batch layout tensors the model runner builds once per step and every
attention layer reads (set before the forward, reset after), so the model's forward signature stays
(input_ids, positions) as in a plain transformer.
"""

from __future__ import annotations

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
    float32_matmul_high  the linears run their bf16x3 kernel where they have one (LinearBase.packed_high:
                  embeddings under float32_matmul_precision "auto", layers/amx_linear.py)
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
    float32_matmul_high: bool = False


_CONTEXT: AttentionContext | None = None


def set_context(context: AttentionContext | None) -> None:
    """Install the layout of the step about to run (None clears it)."""
    global _CONTEXT
    _CONTEXT = context


def current_lora_batch() -> LoRABatch | None:
    """The running step's LoRA layout (None outside a step or when no token runs under an adapter)."""
    return None if _CONTEXT is None else _CONTEXT.lora


def current_float32_matmul_high() -> bool:
    """True when the running step's linears run their bf16x3 kernel (False outside a step)."""
    return _CONTEXT is not None and _CONTEXT.float32_matmul_high


def get_context() -> AttentionContext:
    """The layout of the running step; attention layers call this."""
    if _CONTEXT is None:
        raise RuntimeError("no attention context set: run the model through ModelRunner.execute_model")
    return _CONTEXT
