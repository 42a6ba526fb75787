"""lora_bgmv (Triton) against lora_bgmv_ref, and the twin against the engine's per-adapter torch product."""

from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.reference import lora_bgmv_ref


def _case(tokens: int, in_features: int, out_features: int, rank: int, slots: int, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    out = torch.randn(tokens, out_features, generator=gen).to(dtype)
    a = (torch.randn(slots, rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = (torch.randn(slots, out_features, rank, generator=gen) / rank**0.5).to(dtype)
    b[-1, :, rank // 2:] = 0  # the last slot: an adapter of half the rank, zero-padded
    slot_index = torch.randint(-1, slots, (tokens,), generator=gen)
    slot_index[0] = -1  # at least one base token
    return [t.to(device) for t in (x, out, a, b, slot_index)]


def test_reference_equals_the_engine_segments() -> None:
    """The twin computes what lora/layers.py's per-adapter gathered matmuls compute."""
    from batchinfer.engine.lora.adapter import LoRAAdapter, LoRALayerWeights
    from batchinfer.engine.lora.layers import LoRABatch, LoRASegment

    x, out, a, b, slot_index = _case(9, 32, 48, 8, 3, torch.float32, "cpu")
    expected = lora_bgmv_ref(x, out.clone(), a, b, slot_index)
    segments = []
    for slot in range(3):
        adapter = LoRAAdapter(f"s{slot}", "", 8, {"k": LoRALayerWeights(a[slot], b[slot])})
        rows = (slot_index == slot).nonzero().flatten()
        if len(rows):
            segments.append(LoRASegment(adapter, rows))
    ours = LoRABatch(segments).apply("k", x, out.clone())
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    base = slot_index < 0
    assert torch.equal(expected[base], out[base])


@pytest.mark.parametrize(("in_features", "out_features", "rank"), [(64, 96, 8), (96, 40, 24)])
def test_kernel_matches_reference(device, in_features, out_features, rank) -> None:
    from batchinfer.kernels import lora_bgmv

    dtypes = [torch.float32] if device.type == "cpu" else [torch.float32, torch.bfloat16]
    tokens = 7 if device.type == "cpu" else 300
    for dtype in dtypes:
        x, out, a, b, slot_index = _case(tokens, in_features, out_features, rank, 3, dtype, device)
        expected = lora_bgmv_ref(x, out.clone(), a, b, slot_index)
        got = lora_bgmv(x, out.clone(), a, b, slot_index)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
        torch.testing.assert_close(got, expected, **tolerance)
        base = slot_index < 0
        assert torch.equal(got[base], out[base])  # base tokens untouched


def test_kernel_checks_shapes(device) -> None:
    from batchinfer.kernels import lora_bgmv

    x, out, a, b, slot_index = _case(4, 16, 8, 4, 2, torch.float32, device)
    with pytest.raises(ValueError, match="do not fit"):
        lora_bgmv(x, out, a, b[:, :4], slot_index)


def test_engine_batch_kernel_path_equals_torch_path(device) -> None:
    """build_lora_batch with a StackCache (the CUDA path) adds what the per-segment torch product adds:
    adapters of different ranks, one that leaves the module alone, base rows in between."""
    from batchinfer.engine.lora.adapter import LoRAAdapter, LoRALayerWeights
    from batchinfer.engine.lora.layers import StackCache, build_lora_batch

    gen = torch.Generator().manual_seed(3)

    def adapter(name: str, rank: int, keys: tuple[str, ...]) -> LoRAAdapter:
        weights = {key: LoRALayerWeights(torch.randn(rank, 32, generator=gen).to(device) / 6,
                                         torch.randn(24, rank, generator=gen).to(device) / 3) for key in keys}
        return LoRAAdapter(name, "", rank, weights)

    first, second = adapter("a", 4, ("k", "other")), adapter("b", 8, ("k",))
    third = adapter("c", 2, ("other",))
    entries, q_lens = [first, None, second, first, third, None], [3, 2, 1, 4, 2, 1]
    x = torch.randn(sum(q_lens), 32, generator=gen).to(device)
    out = torch.randn(sum(q_lens), 24, generator=gen).to(device)
    cache = StackCache()
    for key in ("k", "other", "absent"):
        torch_path = build_lora_batch(entries, q_lens, device).apply(key, x, out.clone())
        kernel_path = build_lora_batch(entries, q_lens, device, cache).apply(key, x, out.clone())
        torch.testing.assert_close(kernel_path, torch_path, atol=1e-5, rtol=1e-5)
    assert torch.equal(build_lora_batch(entries, q_lens, device, cache).apply("absent", x, out.clone()), out)
