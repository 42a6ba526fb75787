"""Paged attention layer: writes the step's new K/V into the paged cache through slot_mapping, then
attends each query to its sequence's cached keys read through the block table.

Two backends, picked per step by the model runner (EngineConfig.attention_backend):
- "triton" (CUDA): kernels.store_kvcache + kernels.paged_attention, one launch each per layer.
- "torch" (CPU, or forced): the cache is read by whole blocks into padded batches and handed to one
  scaled_dot_product_attention call per group of similar-length sequences. The gather indices and masks
  depend only on the batch layout, so `build_torch_plan` computes them once per step for all layers.
  On CPU in float32, decode tokens (one query per sequence) instead go to the native kernel of
  cpu_attention, which reads the blocks in place (no padded copy); prefill chunks keep SDPA.

Cache layout (shared contract 4): k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.context import get_context

# A group of sequences is padded to its longest member; a sequence joins the current group while the
# padded work stays within this factor of the real work (or the waste is tiny), else it opens a new group.
GROUP_WASTE_FACTOR = 1.3
GROUP_WASTE_SLACK = 64  # block-rows (query rows x blocks) of padding always tolerated


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded SDPA call.

    token_index [n*q_len]  packed token feeding each padded query row (pad rows repeat a real token)
    valid_rows             rows of the padded output that are real queries (None = all of them)
    out_index              packed token index of each real row
    block_ids  [n*num_blocks] physical blocks of each sequence, padded with block 0 (masked out)
    mask       [n, 1, q_len, num_blocks*block_size] additive (0 / -inf) in the model dtype
    """

    num_seqs: int
    q_len: int
    num_blocks: int
    token_index: torch.Tensor
    valid_rows: torch.Tensor | None
    out_index: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor


@dataclass
class NativeDecodeBatch:
    """Decode tokens handed to the native CPU kernel in one call."""

    token_index: torch.Tensor | None  # packed rows of the decode tokens (None = every token, in order)
    block_tables: torch.Tensor  # [Sd, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [Sd] int32


@dataclass
class TorchAttentionPlan:
    """What the torch backend needs per step: where to store new K/V and the attention groups."""

    store_slots: torch.Tensor  # [T'] int64 cache slots of the tokens written
    store_rows: torch.Tensor | None  # packed rows written (None = all tokens, in order)
    groups: list[AttentionGroup]
    native_decode: NativeDecodeBatch | None = None


def _make_groups(items: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Greedy grouping of (seq, q_len, num_blocks) sorted by size, bounding the padding waste."""
    items = sorted(items, key=lambda item: (item[1], item[2]))
    groups: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    max_q = max_nb = actual = 0
    for item in items:
        _, q_len, nb = item
        new_q, new_nb = max(max_q, q_len), max(max_nb, nb)
        new_actual = actual + q_len * nb
        padded = (len(current) + 1) * new_q * new_nb
        if current and padded > GROUP_WASTE_FACTOR * new_actual and padded - new_actual > GROUP_WASTE_SLACK:
            groups.append(current)
            current, new_q, new_nb, new_actual = [], q_len, nb, q_len * nb
        current.append(item)
        max_q, max_nb, actual = new_q, new_nb, new_actual
    if current:
        groups.append(current)
    return groups


def build_torch_plan(
    *,
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    native_decode: bool = False,
) -> TorchAttentionPlan:
    """Gather indices and masks of one step for the torch backend (computed once, used by every layer).

    native_decode: send the q_len == 1 sequences to cpu_attention's kernel instead of SDPA groups.
    """
    skip = slot_mapping < 0
    if bool(skip.any()):
        store_rows = torch.nonzero(~skip).flatten()
        store_slots = slot_mapping[store_rows]
    else:
        store_rows, store_slots = None, slot_mapping
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    items = [(s, q, -(-seq_lens[s] // block_size)) for s, q in enumerate(q_lens) if q > 0]
    native = None
    if native_decode:
        decodes = [s for s, q, _ in items if q == 1]
        items = [item for item in items if item[1] != 1]
        if decodes:
            native = _native_decode_batch(decodes, starts, seq_lens, block_tables, block_size, device)
    groups = []
    for members in _make_groups(items):
        n = len(members)
        q_max = max(q for _, q, _ in members)
        nb_max = max(nb for _, _, nb in members)
        token_index, valid_rows, out_index, block_ids = [], [], [], []
        for i, (s, q_len, nb) in enumerate(members):
            first = starts[s]
            token_index.extend(first + min(r, q_len - 1) for r in range(q_max))
            valid_rows.extend(range(i * q_max, i * q_max + q_len))
            out_index.extend(range(first, first + q_len))
            block_ids.extend(block_tables[s][:nb])
            block_ids.extend([0] * (nb_max - nb))
        lens = torch.tensor([seq_lens[s] for s, _, _ in members])
        qls = torch.tensor([q for _, q, _ in members])
        query_pos = (lens - qls)[:, None] + torch.arange(q_max)[None, :]  # pad rows: past the end
        key_pos = torch.arange(nb_max * block_size)
        visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).unsqueeze(1)
        all_valid = len(valid_rows) == n * q_max
        groups.append(
            AttentionGroup(
                num_seqs=n,
                q_len=q_max,
                num_blocks=nb_max,
                token_index=torch.tensor(token_index, dtype=torch.long).to(device),
                valid_rows=None if all_valid else torch.tensor(valid_rows, dtype=torch.long).to(device),
                out_index=torch.tensor(out_index, dtype=torch.long).to(device),
                block_ids=torch.tensor(block_ids, dtype=torch.long).to(device),
                mask=mask.to(device),
            )
        )
    return TorchAttentionPlan(store_slots=store_slots, store_rows=store_rows, groups=groups, native_decode=native)


def _native_decode_batch(
    decodes: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> NativeDecodeBatch:
    counts = [-(-seq_lens[s] // block_size) for s in decodes]
    width = max(counts)
    tables = [block_tables[s][:n] + [0] * (width - n) for s, n in zip(decodes, counts, strict=True)]
    rows = [starts[s] for s in decodes]
    in_order = rows == list(range(starts[-1]))  # the step is decode-only
    return NativeDecodeBatch(
        token_index=None if in_order else torch.tensor(rows, dtype=torch.long).to(device),
        block_tables=torch.tensor(tables, dtype=torch.int32).to(device),
        seq_lens=torch.tensor([seq_lens[s] for s in decodes], dtype=torch.int32).to(device),
    )


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Store k/v [T, Hkv, D] into the cache, then attend q [T, H, D]; returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if plan.store_rows is not None:
        k, v = k.index_select(0, plan.store_rows), v.index_select(0, plan.store_rows)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.store_slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.store_slots, v)
    k_blocks, v_blocks = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    out = torch.empty_like(q)
    native = plan.native_decode
    if native is not None:
        if native.token_index is None:
            cpu_attention.paged_decode_attention(out, q, k_cache, v_cache, native.block_tables, native.seq_lens, scale)
        else:
            queries = q.index_select(0, native.token_index)
            o = cpu_attention.paged_decode_attention(
                torch.empty_like(queries), queries, k_cache, v_cache, native.block_tables, native.seq_lens, scale
            )
            out.index_copy_(0, native.token_index, o)
    for g in plan.groups:
        n, length = g.num_seqs, g.num_blocks * block_size
        # [n, Hkv, L, D] views over rows gathered whole blocks at a time (contiguous copies of block_size rows).
        keys = k_blocks.index_select(0, g.block_ids).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        values = v_blocks.index_select(0, g.block_ids).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        queries = q.index_select(0, g.token_index)
        if g.q_len == 1:
            # Decode: the G query heads sharing a kv head act as G query rows, so no kv head is repeated.
            queries = queries.view(n, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale)
            o = o.reshape(n, num_heads, head_dim)
        else:
            queries = queries.view(n, g.q_len, num_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=group > 1
            )
            o = o.transpose(1, 2).reshape(n * g.q_len, num_heads, head_dim)
            if g.valid_rows is not None:
                o = o.index_select(0, g.valid_rows)
        out.index_copy_(0, g.out_index, o)
    return out


class Attention(nn.Module):
    """Attention over the paged KV cache of this layer (k_cache/v_cache are bound by the model runner)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (rotated) -> attention output [T, H * D]."""
        ctx = get_context()
        if ctx.backend == "triton":
            import kernels

            kernels.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
            o = kernels.paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                cu_seqlens_q=ctx.cu_seqlens_q,
                seq_lens=ctx.seq_lens,
                block_tables=ctx.block_tables,
                scale=self.scale,
                max_seqlen_q=ctx.max_seqlen_q,
                max_seqlen_k=ctx.max_seqlen_k,
            )
        else:
            if ctx.torch_plan is None:
                raise RuntimeError("torch attention backend selected but the step has no torch plan")
            o = torch_paged_attention(q, k, v, self.k_cache, self.v_cache, ctx.torch_plan, self.scale)
        return o.reshape(-1, self.num_heads * self.head_dim)
