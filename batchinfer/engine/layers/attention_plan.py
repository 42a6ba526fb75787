"""The torch attention backend's per-step plan: which cache slots the new K/V go to, and how the
sequences are grouped into padded scaled_dot_product_attention calls (gather indices and masks).

It depends only on the batch layout, so the model runner builds it once per step (build_torch_plan)
and every attention layer reads it from the step's AttentionContext. The cache-free "dense" forward of
packed embeddings inputs has its own, simpler plan (build_dense_groups: causal SDPA per group, no cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    return _cut_by_waste(sorted(items, key=lambda item: (item[1], item[2])))


def _cut_by_waste(items: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Consecutive runs of (id, q_len, num_blocks), each padded to its largest q_len x num_blocks within
    GROUP_WASTE_FACTOR of its items' own work (or GROUP_WASTE_SLACK more), in the order given."""
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
        token_index: list[int] = []
        valid_rows: list[int] = []
        out_index: list[int] = []
        block_ids: list[int] = []
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
        key_row = key_pos[None, None, :]
        visible = (key_row <= query_pos[:, :, None]) & (key_row < lens[:, None, None])
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
    return TorchAttentionPlan(
        store_slots=store_slots, store_rows=store_rows, groups=groups, native_decode=native
    )


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


@dataclass
class DenseGroup:
    """Whole inputs of a cache-free packed forward attended in one causal SDPA call, padded at the end.

    Right padding keeps causal attention exact for the real rows: a real query sees only earlier positions
    of its own input, never a pad. The group's members are consecutive in the packing.
    token_index [n*length] packed token feeding each padded row (None: the group has no padding)
    valid_rows  rows of the padded output that are real tokens, in packed order (None: all of them)
    """

    start: int  # first packed token of the group
    num_seqs: int
    length: int
    token_index: torch.Tensor | None
    valid_rows: torch.Tensor | None


def build_dense_groups(lengths: list[int], device: torch.device) -> list[DenseGroup]:
    """Groups of the packed inputs (lengths in packing order, ascending best), bounding the padded work.

    Attention work grows with length squared, so a group's padding is judged by n * max_len**2 against the
    sum of len**2 (GROUP_WASTE_FACTOR, GROUP_WASTE_SLACK as the paged groups).
    """
    if any(size < 1 for size in lengths):
        raise ValueError("an embeddings input needs at least one token")
    groups: list[DenseGroup] = []
    first = 0  # packed row of the run's first token
    # Dense attention work is n * length**2: the paged groups' q_len x num_blocks with both = length.
    for run in _cut_by_waste([(i, size, size) for i, size in enumerate(lengths)]):
        members = [size for _, size, _ in run]
        length, n = max(members), len(members)
        token_index: list[int] = []
        valid_rows: list[int] = []
        at = first
        for i, size in enumerate(members):
            token_index.extend(at + min(r, size - 1) for r in range(length))  # pad rows repeat the last token
            valid_rows.extend(range(i * length, i * length + size))
            at += size
        padded = len(valid_rows) != n * length
        groups.append(DenseGroup(
            start=first, num_seqs=n, length=length,
            token_index=torch.tensor(token_index, dtype=torch.long, device=device) if padded else None,
            valid_rows=torch.tensor(valid_rows, dtype=torch.long, device=device) if padded else None,
        ))
        first = at
    return groups


def attend_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: AttentionGroup,
                 out: torch.Tensor, *, scale: float, num_kv_heads: int) -> None:
    """One SDPA call for a group's queries over its keys / values [n, Hkv, L, D]; writes its rows of out.

    Shared by the plain (attention.py) and the quantized cache (quantized_attention.py), which differ only
    in how the group's keys and values are read."""
    n, num_heads, head_dim = g.num_seqs, q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
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
