"""float32 GEMMs on AMX's bf16 tiles (csrc/amx_gemm.cpp, amx_linear.py; float32_matmul_precision): the
bf16x3 product against float64 (rows, columns and K off the tile grid, the row chunks of a prefill, bias),
closer than one bf16 product; which setting runs where (EngineConfig, by CPU flags); "high" packs every
linear and the head and keeps the logits of IEEE float32; "auto" runs embeddings only in bf16x3, once
packed; and the sources (amx_block_gemm.cpp's too) compile for CPUs without AMX."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers import amx_linear, weight_packing
from batchinfer.engine.native import cpu_features
from batchinfer.engine.native.build import CSRC_DIR
from tests.engine.test_models import make_runner, prefill_and_decode_logits

EXT = amx_linear.amx_extension()
needs_amx = pytest.mark.skipif(EXT is None, reason="the bf16x3 GEMM needs a CPU with AMX bf16 tiles")
AMX_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
BF16X3_TOLERANCE = 2e-5  # bench/panel_gemm.py measures ~5e-6 of the output's largest value; one bf16: ~2e-3


def _relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> float:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return float((got.double() - exact).abs().max() / exact.abs().max())


@needs_amx
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 33, 96, 127, 128, 129, 300])
@pytest.mark.parametrize(("n", "k"),
                         [(32, 32), (16, 64), (40, 7), (96, 576), (576, 1536), (17, 33), (200, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bf16x3_is_the_float32_product_to_a_few_parts_per_million(m: int, n: int, k: int,
                                                                  with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = amx_linear.AmxLinear(weight, bias, EXT)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert _relative_error(got, x, weight, bias) < BF16X3_TOLERANCE


@needs_amx
def test_bf16x3_is_far_closer_than_one_bf16_product() -> None:
    gen = torch.Generator().manual_seed(7)
    weight, x = torch.randn(192, 576, generator=gen), torch.randn(64, 576, generator=gen)
    one_product = (x.bfloat16().float() @ weight.bfloat16().float().T)
    three = amx_linear.AmxLinear(weight, None, EXT)(x)
    assert _relative_error(three, x, weight, None) * 20 < _relative_error(one_product, x, weight, None)


@needs_amx
def test_amx_linear_keeps_leading_dimensions_and_refuses_a_wrong_width() -> None:
    kernel = amx_linear.AmxLinear(torch.randn(48, 40), None, EXT)
    assert kernel(torch.randn(2, 3, 40)).shape == (2, 3, 48)
    for width in (72, 39):  # another tile, and the same 32-wide tile as 40
        with pytest.raises(ValueError, match=f"x has {width} features, the weight 40"):
            kernel(torch.randn(4, width))


@needs_amx
def test_a_non_finite_input_spoils_only_its_own_outputs() -> None:
    """inf in x (or W) gives nan where IEEE gives inf (inf x 0 in the split), in its row (column) only."""
    weight, x = torch.ones(40, 32), torch.ones(3, 32)
    x[1, 7] = float("inf")
    got = amx_linear.AmxLinear(weight, None, EXT)(x)
    assert not torch.isfinite(got[1]).any()
    assert torch.equal(got[[0, 2]], torch.full((2, 40), 32.0))
    weight[33, 0] = float("-inf")
    got = amx_linear.AmxLinear(weight, None, EXT)(torch.ones(2, 32))
    assert not torch.isfinite(got[:, 33]).any()
    assert torch.equal(got[:, [i for i in range(40) if i != 33]], torch.full((2, 39), 32.0))


def test_panels_unpack_to_the_exact_weight() -> None:
    ext = weight_packing.panel_extension()
    if ext is None:
        pytest.skip("the panel GEMM needs an AVX2 + FMA build")
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    weight, bias = torch.randn(45, 70), torch.randn(45)
    module.packed = weight_packing.PanelLinear(weight, bias, ext)
    found = amx_linear.dense_weight(module)
    assert found is not None and torch.equal(found[0], weight) and torch.equal(found[1], bias)


@pytest.mark.parametrize(("flags", "kwargs", "expected"), [
    (AMX_FLAGS, {"dtype": "float32"}, "auto"),
    (AMX_FLAGS, {"dtype": "float32", "float32_matmul_precision": "high"}, "high"),
    (AMX_FLAGS, {"dtype": "float32", "float32_matmul_precision": "highest"}, "highest"),
    (AMX_FLAGS, {"dtype": "bfloat16", "float32_matmul_precision": "high"}, "highest"),
    (AMX_FLAGS, {"dtype": "float32", "quantization": "int8", "float32_matmul_precision": "high"}, "highest"),
    (AMX_FLAGS, {"dtype": "float32", "tensor_parallel_size": 2}, "auto"),  # every rank runs ModelRunner.embed
    (AMX_FLAGS - {"amx_bf16"}, {"dtype": "float32", "float32_matmul_precision": "high"}, "highest"),
    (AMX_FLAGS - {"avx512_bf16"}, {"dtype": "float32"}, "highest"),  # x is split by AVX-512 bf16 converts
    (frozenset({"avx2", "fma"}), {"dtype": "float32"}, "highest"),
])
def test_the_setting_resolves_by_cpu_dtype_and_weights(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str],
                                                       kwargs: dict, expected: str) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    config = EngineConfig(model="m", device="cpu", **kwargs)
    assert config.resolved_float32_matmul_precision() == expected


def test_cpu_linear_onednn_keeps_ieee_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's packed layout cannot be unpacked into the bf16 halves: the identity must not claim them."""
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setenv(weight_packing.CPU_LINEAR_ENV, "onednn")
    config = EngineConfig(model="m", device="cpu", dtype="float32", float32_matmul_precision="high")
    assert config.resolved_float32_matmul_precision() == "highest"


def test_an_unknown_setting_names_the_choices() -> None:
    with pytest.raises(ValueError, match="float32_matmul_precision: must be one of auto, highest, high; got"):
        EngineConfig(model="m", float32_matmul_precision="medium")


@needs_amx
def test_high_runs_every_linear_and_the_head_in_bf16x3_with_float32_logits(tiny_llama: Path) -> None:
    high = make_runner(tiny_llama, float32_matmul_precision="high")
    assert isinstance(high.model.lm_head.packed, amx_linear.AmxLinear)
    assert isinstance(high.model.model.layers[0].self_attn.qkv_proj.packed, amx_linear.AmxLinear)
    assert high.native_step is not None  # the C++ decoder stack runs the AMX kind too
    highest = make_runner(tiny_llama, float32_matmul_precision="highest")
    assert not isinstance(highest.model.lm_head.packed, amx_linear.AmxLinear)
    got, expected = prefill_and_decode_logits(high), prefill_and_decode_logits(highest)
    # through two layers and their norms: ~2e-5 of the largest logit (bf16 weights: ~1e-2)
    assert float((got - expected).abs().max()) < 1e-4 * float(expected.abs().max())
    assert not torch.equal(got, expected)  # bf16x3 ran: not the IEEE sums bit for bit


def test_high_where_no_kernel_runs_says_so_and_runs_float32(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A CPU whose flags promise AMX but whose kernels are not there (not built, refused the tile state)."""
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(amx_linear, "amx_extension", lambda: None)
    runner = make_runner(tiny_llama, float32_matmul_precision="high")
    assert "no linear runs bf16x3 here" in caplog.text
    assert not isinstance(runner.model.lm_head.packed, amx_linear.AmxLinear)
    highest = make_runner(tiny_llama, float32_matmul_precision="highest")
    assert torch.equal(prefill_and_decode_logits(runner), prefill_and_decode_logits(highest))


@needs_amx
def test_auto_runs_embeddings_in_bf16x3_and_generation_in_float32(tiny_llama: Path) -> None:
    auto = make_runner(tiny_llama, float32_matmul_precision="auto")
    highest = make_runner(tiny_llama, float32_matmul_precision="highest")
    qkv = auto.model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_high is None  # nothing packed until the first embeddings
    assert torch.equal(prefill_and_decode_logits(auto), prefill_and_decode_logits(highest))
    inputs = [[5, 9, 2, 7, 11, 3], [8, 1, 4], [7] * 40]
    got, expected = torch.tensor(auto.embed(inputs)), torch.tensor(highest.embed(inputs))
    assert isinstance(qkv.packed_high, amx_linear.AmxLinear)
    assert auto.model.lm_head.packed is not None and qkv.packed is not None  # generation keeps IEEE
    assert (got * expected).sum(-1).min() > 0.99999
    assert not torch.equal(got, expected)
    assert torch.equal(torch.tensor(auto.embed(inputs)), got)  # packed once, the same kernel again
    assert torch.equal(prefill_and_decode_logits(auto), prefill_and_decode_logits(highest))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("isa", [["-mavx2", "-mfma"], ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]])
@pytest.mark.parametrize("source", ["amx_gemm.cpp", "amx_block_gemm.cpp"])
def test_the_kernel_source_compiles_without_amx(isa: list[str], source: str) -> None:
    """The build is -march=native: a CPU without AMX compiles the stubs (amx_gemm_built() false)."""
    torch_include = Path(torch.__file__).parent / "include"
    command = ["g++", "-std=c++20", "-fsyntax-only", "-fopenmp", *isa, "-I", str(CSRC_DIR),
               "-isystem", str(torch_include), "-isystem", str(torch_include / "torch/csrc/api/include"),
               "-isystem", sysconfig.get_paths()["include"], str(CSRC_DIR / source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
