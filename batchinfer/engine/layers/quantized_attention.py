"""Paged attention over a quantized KV cache (kv_quant.py's formats): the torch path, any CPU build.

The step's K/V are quantized on write (one row per token and kv head); each attention group gathers its
sequences' blocks of codes and params and dequantizes them into the model dtype for one SDPA call, as
attention.torch_paged_attention does over an unquantized cache (same plan, same masks).

Decode groups (one query per sequence) over int8 / u8 codes go to the native kernel instead
(cpu_attention.paged_decode_attention_quantized, issue 34): it reads the codes and params straight from the
blocks and dequantizes in registers, so the quantized cache reads half the bytes of a bf16 one where the
gather + dequantize + SDPA path wrote and read a dequantized copy (2.9-4.9x slower than a bf16 cache).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.attention_plan import AttentionGroup, TorchAttentionPlan
from batchinfer.engine.layers.kv_quant import KVCacheFormat, dequantize, quantize


@dataclass
class QuantizedKV:
    """One layer's quantized cache: codes [NB, BS, Hkv, D], params [NB, BS, Hkv, P] float32 (None: P = 0)."""

    fmt: KVCacheFormat
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_params: torch.Tensor | None
    v_params: torch.Tensor | None


def _store(codes: torch.Tensor, params: torch.Tensor | None, x: torch.Tensor, fmt: KVCacheFormat,
           slots: torch.Tensor) -> None:
    num_kv_heads, head_dim = codes.shape[2], codes.shape[3]
    new_codes, new_params = quantize(x, fmt)
    # through a byte view: index_copy_ has no float8 kernel on CPU
    codes.view(torch.uint8).view(-1, num_kv_heads, head_dim * codes.itemsize).index_copy_(
        0, slots, new_codes.view(torch.uint8).reshape(-1, num_kv_heads, head_dim * codes.itemsize))
    if params is not None and new_params is not None:
        params.view(-1, num_kv_heads, fmt.num_params).index_copy_(0, slots, new_params)


def _gather(codes: torch.Tensor, params: torch.Tensor | None, block_ids: torch.Tensor, fmt: KVCacheFormat,
            n: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, Hkv, L, D] values of the blocks block_ids (n sequences' whole blocks), in dtype."""
    num_blocks, block_size, num_kv_heads, head_dim = codes.shape
    rows = codes.view(torch.uint8).view(num_blocks, -1).index_select(0, block_ids).view(codes.dtype)
    rows = rows.view(n, -1, num_kv_heads, head_dim)
    row_params = None
    if params is not None:
        row_params = params.view(num_blocks, -1).index_select(0, block_ids).view(n, -1, num_kv_heads,
                                                                                  fmt.num_params)
    return dequantize(rows, row_params, fmt, dtype).transpose(1, 2)


# A decode group's block tables and lengths, built by its first layer and reused by the others of the step;
# keyed by id(group) with a weak reference that proves the id still names that group.
_TABLES: dict[int, tuple[weakref.ref[AttentionGroup], torch.Tensor, torch.Tensor]] = {}


def _native_tables(g: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables [n, nb] int32, seq_lens [n] int32) of a decode group, from its block ids and mask."""
    cached = _TABLES.get(id(g))
    if cached is not None and cached[0]() is g:
        return cached[1], cached[2]
    tables = g.block_ids.view(g.num_seqs, g.num_blocks).to(torch.int32)
    lens = (g.mask.view(g.num_seqs, -1) == 0).sum(-1).to(torch.int32)  # visible keys: 0, masked: -inf
    if len(_TABLES) > 64:  # a step has a few groups: drop the previous steps'
        _TABLES.clear()
    _TABLES[id(g)] = (weakref.ref(g), tables, lens)
    return tables, lens


def _native_decode(cache: QuantizedKV, dtype: torch.dtype) -> bool:
    """True when the native kernel reads this cache's decode groups (int8 / u8 codes, one scale row each)."""
    return (cache.k_params is not None and cache.v_params is not None and cache.k_codes.device.type == "cpu"
            and cache.fmt.name in ("int8", "u8") and cpu_attention.supports_quantized(cache.k_codes.dtype,
                                                                                      dtype))


def quantized_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: QuantizedKV,
                              plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
    """Store k/v [T, Hkv, D] quantized into the cache, then attend q [T, H, D]; returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.k_codes.shape[2]
    group = num_heads // num_kv_heads
    if plan.store_rows is not None:
        k, v = k.index_select(0, plan.store_rows), v.index_select(0, plan.store_rows)
    _store(cache.k_codes, cache.k_params, k, cache.fmt, plan.store_slots)
    _store(cache.v_codes, cache.v_params, v, cache.fmt, plan.store_slots)
    if plan.native_decode is not None:
        raise RuntimeError("a quantized KV cache runs its decode tokens in the attention groups")
    out = torch.empty_like(q)
    native = _native_decode(cache, q.dtype)
    for g in plan.groups:
        n = g.num_seqs
        if native and g.q_len == 1 and cache.k_params is not None and cache.v_params is not None:
            tables, lens = _native_tables(g)
            o = cpu_attention.paged_decode_attention_quantized(
                torch.empty(n, num_heads, head_dim, dtype=q.dtype), q.index_select(0, g.token_index),
                cache.k_codes, cache.v_codes, cache.k_params, cache.v_params, tables, lens, scale)
            out.index_copy_(0, g.out_index, o)
            continue
        keys = _gather(cache.k_codes, cache.k_params, g.block_ids, cache.fmt, n, q.dtype)
        values = _gather(cache.v_codes, cache.v_params, g.block_ids, cache.fmt, n, q.dtype)
        queries = q.index_select(0, g.token_index)
        if g.q_len == 1:  # decode: the G query heads sharing a kv head act as G query rows
            queries = queries.view(n, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale)
            o = o.reshape(n, num_heads, head_dim)
        else:
            queries = queries.view(n, g.q_len, num_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale,
                                               enable_gqa=group > 1)
            o = o.transpose(1, 2).reshape(n * g.q_len, num_heads, head_dim)
            if g.valid_rows is not None:
                o = o.index_select(0, g.valid_rows)
        out.index_copy_(0, g.out_index, o)
    return out
