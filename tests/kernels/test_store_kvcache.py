"""store_kvcache (Triton) against store_kvcache_ref, and the twin against a per-token loop."""

from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.reference import store_kvcache_ref


def _case(num_tokens: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
          dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0):
    """New K/V rows as strided views of a fused qkv output, distinct random slots, every third one -1."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    to = {"device": device}
    return key.to(**to), value.to(**to), k_cache.to(**to), v_cache.to(**to), slots.to(**to)


def test_reference_matches_a_token_loop() -> None:
    key, value, k_cache, v_cache, slots = _case(40, 8, 16, 2, 64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // 16, slot % 16] = key[i]
            want_v[slot // 16, slot % 16] = value[i]
    store_kvcache_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert not torch.equal(k_cache, _case(40, 8, 16, 2, 64)[2])  # something was written


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (2, 128), (8, 128), (3, 80)])
def test_kernel_matches_reference(device, slot_dtype, block_size, num_kv_heads, head_dim) -> None:
    from batchinfer.kernels import store_kvcache

    num_tokens, num_blocks = (24, 4) if device.type == "cpu" else (3000, 400)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    key, value, k_cache, v_cache, slots = _case(num_tokens, num_blocks, block_size, num_kv_heads, head_dim,
                                                dtype, device)
    slots = slots.to(slot_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, want_k, want_v, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rejects_bad_inputs(device) -> None:
    from batchinfer.kernels import store_kvcache

    key, value, k_cache, v_cache, slots = _case(6, 2, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping must be int32/int64"):
        store_kvcache(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="k_cache/v_cache must both be"):
        store_kvcache(key, value, k_cache[..., :32], v_cache, slots)
    with pytest.raises(ValueError, match="contiguous per block"):
        store_kvcache(key, value, k_cache[::2], v_cache[::2], slots)
