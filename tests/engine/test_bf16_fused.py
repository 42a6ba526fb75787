"""The fused CPU ops of a decoder layer (rotary, SiLU-and-mul, add + RMSNorm, K/V store, int8 row scaling)
against the torch ops they replace, in float32 and bfloat16, and the switches that keep the torch path
where the ops do not apply."""

from __future__ import annotations

import pytest
import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.activation import SiluAndMul
from batchinfer.engine.layers.norm import RMSNorm
from batchinfer.engine.layers.rotary import _rotate, rotate_qkv_

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="native CPU extension not built here")
DTYPES = [torch.float32, torch.bfloat16]
# float32: within float rounding; bf16 SiLU-and-mul rounds exactly like torch
ATOL = {torch.float32: 2e-6, torch.bfloat16: 0.0}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * 96, generator=_gen(3)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    with torch.inference_mode():
        torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(gate) * up, atol=ATOL[dtype],
                                   rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rotary_rotates_q_and_k_heads_in_place(dtype: torch.dtype) -> None:
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=_gen(4)).to(dtype)
    cos, sin = (torch.randn(tokens, 1, head_dim // 2, generator=_gen(s)).to(dtype) for s in (5, 6))
    rotated_width = (heads + kv_heads) * head_dim
    expected = _rotate(qkv[:, :rotated_width].reshape(tokens, -1, head_dim), cos, sin).reshape(tokens, -1)
    out = qkv.clone()
    with torch.inference_mode():
        assert rotate_qkv_(out, cos, sin, heads + kv_heads, head_dim)
    atol = 2e-6 if dtype == torch.float32 else 0.07  # bf16: one rounding instead of three
    torch.testing.assert_close(out[:, :rotated_width], expected, atol=atol, rtol=0)
    assert torch.equal(out[:, rotated_width:], qkv[:, rotated_width:])  # v untouched


def test_fused_ops_stay_out_of_autograd_and_other_dtypes() -> None:
    x = torch.randn(2, 8)
    assert cpu_attention.fused_ops_for(x) is None  # grad mode: the torch ops record the graph
    with torch.inference_mode():
        assert cpu_attention.fused_ops_for(x) is not None
        assert cpu_attention.fused_ops_for(x.half()) is None
        assert not rotate_qkv_(torch.randn(2, 8, dtype=torch.float16), torch.ones(2, 1, 4).half(),
                               torch.zeros(2, 1, 4).half(), 1, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_matches_the_torch_ops(monkeypatch, dtype: torch.dtype) -> None:
    """The residual sum is exact; the normalized rows equal the torch ops' (bf16) or are within float
    rounding of them (fp32: only the sum of squares is added up in another order)."""
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=_gen(7)).to(dtype)
    x, residual = (torch.randn(9, 96, generator=_gen(s)).to(dtype) for s in (8, 9))
    with torch.inference_mode():
        fused_sum = norm(x, residual)
        fused_plain = norm(x)
        monkeypatch.setattr(cpu_attention, "_FUSED_OFF", True)
        torch_sum, torch_plain = norm(x, residual), norm(x)
    torch.testing.assert_close(fused_sum[1], torch_sum[1], atol=0, rtol=0)
    atol = 1e-5 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(fused_sum[0], torch_sum[0], atol=atol, rtol=0)
    torch.testing.assert_close(fused_plain, torch_plain, atol=atol, rtol=0)
    assert not torch.equal(fused_sum[0], fused_plain)  # the residual was added


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_rows", [False, True])
def test_fused_kv_store_writes_what_index_copy_writes(dtype: torch.dtype, with_rows: bool) -> None:
    """Strided k/v views of a qkv projection land in their slots, row subsets too; other slots untouched."""
    tokens, kv_heads, head_dim, blocks, block_size = 5, 2, 16, 4, 4
    qkv = torch.randn(tokens, (2 + 2 * kv_heads) * head_dim, generator=_gen(10)).to(dtype)
    width = kv_heads * head_dim
    k, v = (qkv[:, start:start + width].view(tokens, kv_heads, head_dim) for start in (2 * head_dim,
                                                                                        2 * head_dim + width))
    rows = torch.tensor([0, 2, 4]) if with_rows else None
    slots = torch.tensor([3, 9, 14]) if with_rows else torch.tensor([3, 9, 14, 0, 7])
    caches = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    with torch.inference_mode():
        cpu_attention.load().store_kv_(k, v, caches[0], caches[1], slots, rows)
    picked_k, picked_v = (k, v) if rows is None else (k[rows], v[rows])
    caches[2].view(-1, kv_heads, head_dim).index_copy_(0, slots, picked_k)
    caches[3].view(-1, kv_heads, head_dim).index_copy_(0, slots, picked_v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        cpu_attention.load().store_kv_(k, v, caches[0], caches[1], slots + blocks * block_size, rows)
    assert torch.equal(caches[0], caches[2])  # a bad slot is refused before any write


def test_fused_row_scaling_equals_the_torch_ops() -> None:
    """int8's per-token input scaling: x / max|x_row| and the maxima, bit for bit (a zero row stays zero)."""
    x = torch.randn(6, 40, generator=_gen(11))
    x[3] = 0.0
    with torch.inference_mode():
        scaled, row_max = cpu_attention.load().scale_rows(x, 1e-12)
    expected_max = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    assert torch.equal(row_max, expected_max) and torch.equal(scaled, x / expected_max)
