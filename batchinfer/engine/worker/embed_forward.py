"""The packed embeddings forward: many inputs per model call, no KV cache, causal within each input.

Inputs are sorted by length and cut into chunks of at most max_num_batched_tokens tokens (an input longer
than that is a chunk of its own); on a CPU fewer (step_budget.py: the MLP's output stays within what glibc's
malloc keeps for reuse). Each chunk is ONE forward through the model's layers (the same linear,
norm and MLP kernels as a prefill step) over the packed tokens, under a "dense" attention context: the
inputs are grouped by similar length and each group runs one causal SDPA, padded at the end
(attention_plan.build_dense_groups). Nothing is written to the KV cache. Each input's final hidden state
(after the final norm) is mean-pooled by segment sums and L2-normalised; vectors come back in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchinfer.engine.layers.attention_plan import build_dense_groups
from batchinfer.engine.layers.context import AttentionContext, set_context


def plan_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Input indices, sorted by length, cut into chunks of at most budget tokens (one input at least)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        if current and tokens + lengths[i] > budget:
            chunks.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        chunks.append(current)
    return chunks


def embed_chunk(model: torch.nn.Module, token_id_lists: Sequence[list[int]], device: torch.device, *,
                float32_matmul_high: bool = False) -> torch.Tensor:
    """One packed cache-free forward over whole inputs; their pooled, normalised vectors [n, hidden] fp32.

    float32_matmul_high: the linears run their bf16x3 kernel (float32_matmul_precision "auto" on AMX)."""
    lengths = [len(ids) for ids in token_id_lists]
    if min(lengths, default=0) < 1:
        raise ValueError("an embeddings input needs at least one token")
    flat = [t for ids in token_id_lists for t in ids]
    input_ids = torch.tensor(flat, dtype=torch.long, device=device)
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    positions = torch.arange(len(flat)) - torch.repeat_interleave(starts, lengths_t)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    groups = None if len(lengths) == 1 else build_dense_groups(lengths, device)
    set_context(AttentionContext(empty, empty, empty, empty, max(lengths), max(lengths), "dense",
                                 dense_groups=groups, float32_matmul_high=float32_matmul_high))
    try:
        hidden = model(input_ids, positions.to(device))
    finally:
        set_context(None)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t.to(device))
    sums = torch.zeros(len(lengths), hidden.shape[-1], dtype=torch.float32, device=device)
    sums.index_add_(0, segment, hidden.float())
    pooled = sums / lengths_t.to(device=device, dtype=torch.float32)[:, None]
    return torch.nn.functional.normalize(pooled, dim=-1)


def embed_batched(model: torch.nn.Module, token_id_lists: Sequence[list[int]], device: torch.device,
                  budget: int, *, float32_matmul_high: bool = False) -> list[list[float]]:
    """Every input's vector, in input order, running the chunks of plan_chunks(budget) one forward each."""
    out: list[list[float]] = [[] for _ in token_id_lists]
    for chunk in plan_chunks([len(ids) for ids in token_id_lists], budget):
        vectors = embed_chunk(model, [token_id_lists[i] for i in chunk], device,
                              float32_matmul_high=float32_matmul_high).tolist()
        for i, vector in zip(chunk, vectors, strict=True):
            out[i] = vector
    return out
