"""Write the step's new K/V rows into the paged cache at their slots (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._device import check_device


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token or a position whose KV is already cached
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    v = tl.load(value_ptr + src * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask)
    # A cache viewed as [num_blocks * block_size, ...] has one stride per slot (block rows are contiguous).
    k_dst = k_cache_ptr + slot * stride_kc_slot + heads[:, None] * stride_kc_h + dims[None, :]
    v_dst = v_cache_ptr + slot * stride_vc_slot + heads[:, None] * stride_vc_h + dims[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must both be [T, num_kv_heads, head_dim], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError("k_cache/v_cache must both be "
                         f"[num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 of shape [{key.shape[0]}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need a contiguous last dim (head_dim); call .contiguous() first")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError(f"{name} must be contiguous per block "
                             "([num_blocks, block_size, ...] rows in order)")


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i]/value[i] into the cache slot slot_mapping[i] (in place); slots < 0 are skipped."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    check_device(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row_elems = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4 if row_elems >= 2048 else 1,
    )
