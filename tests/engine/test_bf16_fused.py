"""The fused CPU ops of a decoder layer (rotary, SiLU-and-mul) against the torch ops they replace, in
float32 and bfloat16, and the switches that keep the torch path where the ops do not apply."""

from __future__ import annotations

import pytest
import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.activation import SiluAndMul
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
