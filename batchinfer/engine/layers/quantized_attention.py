"""Paged attention over a quantized KV cache (kv_quant.py's formats): the torch path, any CPU build.

The step's K/V are quantized on write, one row per token and kv head: int8 / u8 by the extension's
store_kv_quantized_ in one pass where it is built, else by kv_quant.quantize's torch ops (the same codes).
Each attention group gathers its sequences' blocks of codes and params and dequantizes them into the model
dtype for one SDPA call, as attention.torch_paged_attention does over an unquantized cache (same plan, same
masks).

Decode tokens over int8 / u8 codes go to the native kernel instead, as over a plain cache: the runner asks
the plan for them (ModelRunner.native_decode) and cpu_attention.paged_decode_attention_quantized (issue 34)
reads the codes and params straight from the blocks and dequantizes in registers, so the quantized cache
reads half the bytes of a bf16 one where the gather + dequantize + SDPA path wrote and read a dequantized
copy (2.9-4.9x slower than a bf16 cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.attention_plan import TorchAttentionPlan, attend_group
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


def _store_native(k: torch.Tensor, v: torch.Tensor, cache: QuantizedKV, plan: TorchAttentionPlan) -> bool:
    """Store k/v quantized with the extension's one-pass kernel (int8 / u8 codes); False where it cannot."""
    ops = cpu_attention.fused_ops_for(k)
    if (ops is None or cache.k_params is None or cache.v_params is None
            or cache.k_codes.dtype not in cpu_attention.QUANTIZED_CODES
            or k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride(-2) != k.shape[-1]
            or v.stride(-2) != v.shape[-1]):
        return False
    ops.store_kv_quantized_(k, v, cache.k_codes, cache.v_codes, cache.k_params, cache.v_params,
                            plan.store_slots, plan.store_rows)  # kv_quant.quantize's arithmetic, bit for bit
    return True


def quantized_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: QuantizedKV,
                              plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
    """Store k/v [T, Hkv, D] quantized into the cache, then attend q [T, H, D]; returns [T, H, D]."""
    num_kv_heads = cache.k_codes.shape[2]
    if not _store_native(k, v, cache, plan):
        if plan.store_rows is not None:
            k, v = k.index_select(0, plan.store_rows), v.index_select(0, plan.store_rows)
        _store(cache.k_codes, cache.k_params, k, cache.fmt, plan.store_slots)
        _store(cache.v_codes, cache.v_params, v, cache.fmt, plan.store_slots)
    out = torch.empty_like(q)
    native = plan.native_decode  # int8 / u8 decode tokens (ModelRunner.native_decode: the kernel reads them)
    if native is not None:
        if cache.k_params is None or cache.v_params is None:
            raise ValueError(f"kv_cache_dtype={cache.fmt.name}: the native decode kernel reads int8 / u8 "
                             "codes only")
        if native.token_index is None:
            cpu_attention.paged_decode_attention_quantized(
                out, q, cache.k_codes, cache.v_codes, cache.k_params, cache.v_params, native.block_tables,
                native.seq_lens, scale)
        else:
            queries = q.index_select(0, native.token_index)
            o = cpu_attention.paged_decode_attention_quantized(
                torch.empty_like(queries), queries, cache.k_codes, cache.v_codes, cache.k_params,
                cache.v_params, native.block_tables, native.seq_lens, scale)
            out.index_copy_(0, native.token_index, o)
    for g in plan.groups:
        keys = _gather(cache.k_codes, cache.k_params, g.block_ids, cache.fmt, g.num_seqs, q.dtype)
        values = _gather(cache.v_codes, cache.v_params, g.block_ids, cache.fmt, g.num_seqs, q.dtype)
        attend_group(q, keys, values, g, out, scale=scale, num_kv_heads=num_kv_heads)
    return out
