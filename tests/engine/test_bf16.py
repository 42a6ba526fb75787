"""bfloat16 on CPU: the native decode kernel on a bf16 KV cache, the bf16 runner against fp32, the default.

The kernel is checked against a float32 reference over the same bf16 values (it widens bf16 to float32 in
registers, so only the output's rounding differs) and against the SDPA path of the same bf16 runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig, cpu_has_native_bf16
from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.weight_packing import (
    OneDnnLinear,
    PanelLinear,
    cpu_linear_mode,
    onednn_supports,
)
from tests.engine.test_models import FakeSeq, ScatteredBlocks, make_runner, random_tokens, run_step

needs_kernel = pytest.mark.skipif(cpu_attention.load() is None, reason="native CPU kernel not built here")


def _reference_decode(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Float32 attention of each q[s] over its first seq_lens[s] cached rows, read through the block table."""
    num_seqs, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for s in range(num_seqs):
        pos = torch.arange(int(seq_lens[s]))
        blocks = block_tables[s][pos // block_size].long()
        keys, values = k_cache[blocks, pos % block_size].float(), v_cache[blocks, pos % block_size].float()
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            probs = torch.softmax(q[s, h].float() @ keys[:, kv].T * scale, dim=0)
            out[s, h] = probs @ values[:, kv]
    return out


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 16: portable loops; 64/128: the vectorized branch
def test_bf16_decode_kernel_matches_float32_reference(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 16, 24
    seq_lens = torch.tensor([1, 16, 17, 40, 95], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:6] for _ in seq_lens]).int()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    cpu_attention.paged_decode_attention(out, q, k_cache, v_cache, tables, seq_lens, scale)
    expected = _reference_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)  # bf16 output rounding
    assert torch.equal(out, expected.bfloat16())  # and the rounding is round-to-nearest-even, as torch's


@needs_kernel
def test_kernel_refuses_mixed_dtypes() -> None:
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_attention.paged_decode_attention(torch.empty_like(q), q, cache, cache,
                                             torch.zeros(1, 1, dtype=torch.int32),
                                             torch.ones(1, dtype=torch.int32), 0.25)


@needs_kernel
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_bf16_native_decode_equals_the_sdpa_path_and_tracks_fp32(request, name: str) -> None:
    """Teacher-forced decode on a bf16 runner through the native kernel, the SDPA path, and fp32."""
    path: Path = request.getfixturevalue(name)
    runners = {"native": make_runner(path, dtype="bfloat16", kv_cache_dtype="bf16"),  # a plain bf16 cache
               "sdpa": make_runner(path, dtype="bfloat16", kv_cache_dtype="bf16"),
               "fp32": make_runner(path, dtype="float32")}
    assert runners["native"].native_decode and runners["native"].kv_cache.dtype == torch.bfloat16
    runners["sdpa"].native_decode = False
    vocab = runners["fp32"].hf_config.vocab_size
    prompts = [random_tokens(vocab, n + 6, seed=40 + n) for n in (3, 9, 21)]
    logprobs: dict[str, list[torch.Tensor]] = {}
    for key, runner in runners.items():
        pool = ScatteredBlocks(runner.num_kv_blocks, runner.block_size, seed=5)
        seqs = [FakeSeq(p) for p in prompts]
        steps = [run_step(runner, pool, [(s, len(s.token_ids) - 6) for s in seqs])]
        steps += [run_step(runner, pool, [(s, 1) for s in seqs]) for _ in range(6)]
        assert all(step.dtype == torch.float32 for step in steps)  # logits float32 for sampling
        logprobs[key] = [torch.log_softmax(step, dim=-1) for step in steps]
    for native, sdpa, fp32 in zip(logprobs["native"], logprobs["sdpa"], logprobs["fp32"], strict=True):
        # Same bf16 weights and cache; only the attention's summation order (and its bf16 output) differs,
        # so the two bf16 paths agree far more closely than either agrees with fp32.
        paths_kl = (sdpa.exp() * (sdpa - native)).sum(dim=-1)
        fp32_kl = (fp32.exp() * (fp32 - native)).sum(dim=-1)
        assert float(paths_kl.max()) < 2e-3, f"native and SDPA bf16 paths differ: KL {paths_kl.tolist()}"
        assert float(fp32_kl.max()) < 2e-2, f"bf16 drifted from fp32: KL {fp32_kl.tolist()}"


def test_auto_dtype_is_bf16_exactly_where_the_cpu_has_it(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), device="cpu")
    assert config.resolved_dtype() == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert EngineConfig(model="m", device="cpu", dtype="float32").resolved_dtype() == torch.float32


def test_bf16_linear_layers_are_prepacked_with_or_without_onednn_bf16(tiny_llama: Path) -> None:
    """Every linear and the head are prepacked and the linears' dense weights released: in bf16 where oneDNN
    runs bf16 GEMMs (AVX-512); on an AVX2-only CPU as bf16 panels of the panel GEMM (or, with
    BATCHINFER_CPU_LINEAR=onednn, as the widened fp32 weight of oneDNN's fp32 GEMM)."""
    runner = make_runner(tiny_llama, dtype="bfloat16")
    layer = runner.model.model.layers[0]
    assert runner.model.lm_head.weight.numel() > 0  # the head's matrix stays (it may be the embedding)
    qkv, head = layer.self_attn.qkv_proj.packed, runner.model.lm_head.packed
    assert layer.mlp.down_proj.weight.numel() == 0
    if cpu_linear_mode(torch.bfloat16) == "panel":  # AVX2-only: the panel GEMM, its weights bf16 in memory
        assert isinstance(qkv, PanelLinear) and isinstance(head, PanelLinear)
        assert qkv.panels.dtype == head.panels.dtype == torch.bfloat16
        return
    assert isinstance(qkv, OneDnnLinear) and isinstance(head, OneDnnLinear)
    packed_dtype = torch.bfloat16 if onednn_supports(torch.bfloat16) else torch.float32
    assert qkv.packed.dtype == head.packed.dtype == packed_dtype


def test_widened_bf16_gemm_is_the_bf16_gemm_up_to_summation_order() -> None:
    """bf16 x bf16 products are exact in float32, so the fp32 GEMM over widened values, rounded once, is
    what a bf16 GEMM accumulating in float32 gives; against the float64 product it is off by at most
    bf16's rounding of the output."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    out = OneDnnLinear(weight, bias, compute_dtype=torch.float32)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (7, 96)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.equal(out, exact.float().to(torch.bfloat16)) or \
        ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-6).all()
    assert ((out.float() - torch.nn.functional.linear(x, weight, bias).float()).abs()
            <= exact.abs().float() * 2.0 ** -7 + 1e-3).all()  # the plain bf16 F.linear agrees within an ulp
