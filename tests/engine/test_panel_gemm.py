"""The panel GEMM (csrc/panel_gemm.cpp, weight_packing.PanelLinear; AVX2 tiles, or AVX-512 ones where the
build has AVX-512F) against float64 products: every row-tile remainder, padded panels, odd K, K a multiple
of 256, partial panels of 1 to 15 columns, an odd panel count (AVX-512 tiles read panels in pairs), bias,
bfloat16 weights and activations, the multi-pass rows of a prefill; and where BATCHINFER_CPU_LINEAR picks
it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine.layers import weight_packing
from tests.engine.test_models import make_runner, prefill_and_decode_logits

EXT = weight_packing.panel_extension()
needs_panel = pytest.mark.skipif(EXT is None, reason="the panel GEMM needs an AVX2 + FMA build")


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, weight, bias


@needs_panel
@pytest.mark.parametrize("m", [*range(1, 30), 36, 45, 55, 96, 127, 300, 520])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (40, 7), (200, 1), (96, 576), (24, 512), (17, 33), (31, 16),
                                    (45, 70)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_panel_linear_is_the_float32_product(m: int, n: int, k: int, with_bias: bool) -> None:
    x, weight, bias = _case(m, n, k, torch.float32, seed=m * 1000 + n + k)
    kernel = weight_packing.PanelLinear(weight, bias if with_bias else None, EXT)
    out = kernel(x)
    exact = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # float32 sums of k products and the bias: within k + 1 roundings of the sum of magnitudes
    magnitude = x.double().abs() @ weight.double().abs().T + (bias.double().abs() if with_bias else 0)
    bound = magnitude * (k + 1) * 2.0 ** -24 + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()


@needs_panel
@pytest.mark.parametrize("m", [1, 5, 6, 7, 12, 13, 14, 15, 29, 96, 130, 520])
def test_bf16_panels_are_the_bf16_gemm_up_to_summation_order(m: int) -> None:
    """bf16 weights stay bf16 in memory and are widened exactly; bf16 x bf16 products are exact in float32,
    so the output is the float64 product rounded once to bf16, give or take float32 summation."""
    x, weight, bias = _case(m, 72, 64, torch.bfloat16, seed=m)
    kernel = weight_packing.PanelLinear(weight, bias, EXT)
    assert kernel.panels.dtype == torch.bfloat16
    out = kernel(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 72)
    exact = x.double() @ weight.double().T + bias.double()
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-5).all()


@needs_panel
def test_panel_linear_keeps_leading_dimensions_and_refuses_a_wrong_width() -> None:
    x, weight, _ = _case(6, 24, 32, torch.float32, seed=3)
    kernel = weight_packing.PanelLinear(weight, None, EXT)
    out = kernel(x.view(2, 3, 32))
    torch.testing.assert_close(out, (x @ weight.T).view(2, 3, 24), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and panels"):
        kernel(torch.randn(4, 31))
    with pytest.raises(RuntimeError, match="out_features does not fit"):
        EXT.panel_linear(x, kernel.panels, None, 40)


def test_cpu_linear_mode_resolves_auto_by_cpu_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the panel GEMM for float32 / bf16 weights on an AVX2-only CPU and for float32 on an AVX-512
    one (AMX or not), where the build has it; oneDNN for bf16 on AVX-512, float16 (no panels) and without
    the build."""
    monkeypatch.delenv(weight_packing.CPU_LINEAR_ENV, raising=False)
    avx2, avx512 = frozenset({"avx2", "fma"}), frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    amx = avx512 | {"amx_tile", "amx_bf16", "amx_int8"}
    for flags, built, fp32_mode, bf16_mode in [(avx2, True, "panel", "panel"),
                                               (avx512, True, "panel", "onednn"),
                                               (amx, True, "panel", "onednn"),
                                               (avx2, False, "onednn", "onednn"),
                                               (amx, False, "onednn", "onednn")]:
        extension = object() if built else None
        monkeypatch.setattr(weight_packing, "panel_extension", lambda extension=extension: extension)
        monkeypatch.setattr(weight_packing, "cpu_flags", lambda flags=flags: flags)
        assert weight_packing.cpu_linear_mode(torch.float32) == fp32_mode
        assert weight_packing.cpu_linear_mode(torch.bfloat16) == bf16_mode
        assert weight_packing.cpu_linear_mode(torch.float16) == "onednn"
    monkeypatch.setenv(weight_packing.CPU_LINEAR_ENV, "onednn")
    assert weight_packing.cpu_linear_mode() == "onednn"
    monkeypatch.setenv(weight_packing.CPU_LINEAR_ENV, "mkl")
    with pytest.raises(ValueError, match="BATCHINFER_CPU_LINEAR must be one of auto, onednn, panel, aten"):
        weight_packing.cpu_linear_mode()


@needs_panel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_panel_linears_matches_onednn(tiny_llama: Path, dtype: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill and decode steps with every linear and the head on panels: oneDNN's logits up to rounding."""
    logits = {}
    for mode in ("panel", "onednn"):
        monkeypatch.setenv(weight_packing.CPU_LINEAR_ENV, mode)
        runner = make_runner(tiny_llama, dtype=dtype)
        expected = weight_packing.PanelLinear if mode == "panel" else weight_packing.OneDnnLinear
        assert isinstance(runner.model.lm_head.packed, expected)
        assert isinstance(runner.model.model.layers[0].self_attn.qkv_proj.packed, expected)
        logits[mode] = prefill_and_decode_logits(runner)
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(logits["panel"], logits["onednn"], atol=tolerance, rtol=tolerance)
