"""A GGUF model's float32 linears on AMX over its exact 4-bit blocks (csrc/amx_block_gemm.cpp,
engine/layers/exact_blocks.py): the kernel against float64 at every row and column shape it branches on,
closer than the panel GEMM's float32 and far closer than bf16x3; the bit-for-bit check that admits a
weight (one ulp off is refused); and the real SmolLM2 GGUF in float32: its 120 decoder linears on their
blocks (the native step's too), greedy output identical to the IEEE panel GEMM's, and no block kernel where
BATCHINFER_CPU_LINEAR names another or the model is no GGUF."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers import amx_linear, exact_blocks, weight_packing
from batchinfer.engine.layers.exact_blocks import (
    ExactBlockLinear,
    exact_blocks_source,
    exactly_equal,
    layer_blocks,
    pack_exact_blocks,
)
from batchinfer.engine.layers.gguf_weights import BlockWeight
from batchinfer.engine.llm_engine import Engine
from batchinfer.engine.model_files import gguf_source
from batchinfer.engine.worker.native_step import NativeLinearKind, linear_spec
from tests.engine.test_gguf_weights import generate

EXT = amx_linear.amx_extension()
needs_amx = pytest.mark.skipif(EXT is None, reason="the exact block GEMM needs a CPU with AMX bf16 tiles")
SMOLLM2 = "smollm2-135m-instruct"
FLOAT32_TOLERANCE = 2e-6  # a float32 GEMM's largest error, of the output's largest value (K up to 1536)
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def random_q4(rows: int, columns: int, seed: int) -> BlockWeight:
    """Q4_1-like blocks: codes 0..15, fp16 scales d and offsets m as a GGUF file holds them."""
    gen = torch.Generator().manual_seed(seed)
    groups = columns // 32
    d = (torch.rand(rows, groups, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-8 * d * (1 + 0.2 * torch.randn(rows, groups, generator=gen))).half().float()
    codes = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8, generator=gen)
    return BlockWeight("q4", codes, d, m)


def relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> float:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return float((got.double() - exact).abs().max() / exact.abs().max())


@needs_amx
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 33, 96, 300])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (40, 64), (160, 576), (576, 1536), (17, 96)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_block_gemm_is_float32_accurate(m: int, n: int, k: int, with_bias: bool) -> None:
    """Row tiles singly and in pairs, padded columns (17, 40), pair blocks split across threads (160)."""
    blocks = random_q4(n, k, seed=m * 1000 + n + k)
    weight = blocks.dequantize()
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = ExactBlockLinear(blocks, bias, EXT)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert relative_error(got, x, weight, bias) < FLOAT32_TOLERANCE


@needs_amx
def test_it_is_closer_than_the_panel_gemm_and_far_closer_than_bf16x3() -> None:
    blocks = random_q4(576, 1536, seed=3)
    weight = blocks.dequantize()
    x = torch.randn(96, 1536, generator=torch.Generator().manual_seed(4))
    exact_error = relative_error(ExactBlockLinear(blocks, None, EXT)(x), x, weight, None)
    panels = weight_packing.panel_extension()
    if panels is not None:
        panel = panels.panel_linear(x, panels.pack_panels(weight), None, 576)
        assert exact_error <= relative_error(panel, x, weight, None)
    bf16x3 = amx_linear.AmxLinear(weight, None, EXT)(x)
    assert exact_error * 5 < relative_error(bf16x3, x, weight, None)


@needs_amx
def test_a_non_finite_input_spoils_only_its_own_row() -> None:
    blocks = random_q4(64, 64, seed=5)
    x = torch.randn(20, 64)
    x[3, 7] = float("inf")
    got = ExactBlockLinear(blocks, None, EXT)(x)
    assert not torch.isfinite(got[3]).all()
    assert torch.isfinite(torch.cat([got[:3], got[4:]])).all()
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        ExactBlockLinear(blocks, None, EXT)(torch.randn(2, 32))


@needs_amx
def test_x_is_split_exactly_so_a_one_hot_weight_returns_it_bit_for_bit() -> None:
    """d = 1, m = 0, one code 1 per column: y = x, bit for bit, for normal values down to ~2^-100 (near
    powers of two, negatives, zeros); a subnormal x counts as zero (bf16 conversions and AMX flush it)."""
    k = 64
    codes = torch.zeros(k, k, dtype=torch.uint8)
    codes[torch.arange(k), torch.arange(k)] = 1  # column n reads x[:, n]
    nibbles = codes.reshape(k, k // 32, 2, 16)
    packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(k, k // 2)
    blocks = BlockWeight("q4", packed, torch.ones(k, k // 32), torch.zeros(k, k // 32))
    assert torch.equal(blocks.dequantize(), torch.eye(k))
    one = torch.tensor(1.0)
    values = [1.0, -1.0, 0.0, -0.0, 1 / 3, -2 / 3, 1e-30, 2.0 ** -100, 123456.789, 3.0e38,
              float(torch.nextafter(one, torch.tensor(2.0))), float(torch.nextafter(one, torch.tensor(0.0))),
              float(torch.nextafter(torch.tensor(2.0), one)), 0.1 + 2.0 ** -20, -7.0e-5]
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([torch.tensor(values), torch.randn(k * 3 - len(values), generator=gen) * 1e3]).reshape(3, k)
    assert torch.equal(ExactBlockLinear(blocks, None, EXT)(x), x)
    tiny = torch.zeros(1, k)
    tiny[0, 0] = 1e-40  # subnormal
    assert ExactBlockLinear(blocks, None, EXT)(tiny)[0, 0] == 0.0


def test_only_a_weight_equal_to_its_blocks_bit_for_bit_is_admitted() -> None:
    blocks = random_q4(8, 64, seed=6)
    weight = blocks.dequantize()
    assert exactly_equal(blocks, weight)
    nudged = weight.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(1.0))
    assert not exactly_equal(blocks, nudged)
    assert not exactly_equal(blocks, weight[:, :32])  # another shape
    assert not exactly_equal(blocks, weight.bfloat16())  # another dtype
    assert not exactly_equal(BlockWeight("q8", torch.zeros(8, 64, dtype=torch.int8), blocks.d, None), weight)


def test_the_check_compares_in_row_chunks_to_the_last_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exact_blocks, "CHECK_ELEMENTS", 128)  # two rows of 64 at a time
    blocks = random_q4(9, 64, seed=12)
    weight = blocks.dequantize()
    assert exactly_equal(blocks, weight)
    weight[8, 63] = torch.nextafter(weight[8, 63], torch.tensor(-1.0))
    assert not exactly_equal(blocks, weight)


def test_the_kernel_runs_only_for_a_float32_gguf_model_on_one_cpu_rank(
        smollm2, tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("BATCHINFER_CPU_LINEAR", raising=False)
    common = {"model": SMOLLM2, "dtype": torch.float32, "device": cpu, "quantization": None, "ranks": 1}
    expected = gguf_source(SMOLLM2) if EXT is not None else None
    assert exact_blocks_source(**common) == expected
    assert exact_blocks_source(**{**common, "model": str(tiny_llama)}) is None  # safetensors: no blocks
    assert exact_blocks_source(**{**common, "dtype": torch.bfloat16}) is None
    assert exact_blocks_source(**{**common, "quantization": "gguf"}) is None
    assert exact_blocks_source(**{**common, "ranks": 2}) is None
    monkeypatch.setenv("BATCHINFER_CPU_LINEAR", "panel")  # the A/B switch: the panel GEMM
    assert exact_blocks_source(**common) is None


@pytest.fixture(scope="module")
def smollm2_float32(smollm2, single_thread) -> Iterator[dict[str, Engine]]:
    """SmolLM2 in float32 on its exact blocks and on the panel GEMM (BATCHINFER_CPU_LINEAR=panel)."""
    if EXT is None:
        pytest.skip("the exact block GEMM needs a CPU with AMX bf16 tiles")
    engines = {}
    with pytest.MonkeyPatch.context() as patch:
        for mode in ("auto", "panel"):
            patch.setenv("BATCHINFER_CPU_LINEAR", mode)
            engines[mode] = Engine(EngineConfig(model=SMOLLM2, device="cpu", dtype="float32",
                                                adaptive_threads=False))
    yield engines
    for engine in engines.values():
        engine.close()


def test_every_smollm2_decoder_linear_runs_on_its_exact_blocks(smollm2_float32) -> None:
    runner = smollm2_float32["auto"].model_runner
    linears = [layer.get_submodule(name) for layer in runner.model.model.layers for name in LINEARS]
    assert len(linears) == 120
    for module in linears:
        assert isinstance(module.packed, ExactBlockLinear)
        spec = linear_spec(module)
        assert spec is not None and spec[0] == NativeLinearKind.AMX_BLOCKS
    assert not isinstance(runner.model.lm_head.packed, ExactBlockLinear)  # the head screen reads its table
    panel_runner = smollm2_float32["panel"].model_runner
    assert not any(isinstance(m.packed, ExactBlockLinear)
                   for layer in panel_runner.model.model.layers for m in map(layer.get_submodule, LINEARS))


def test_greedy_output_equals_the_panel_gemms(smollm2_float32) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3,"]
    assert generate(smollm2_float32["auto"], prompts, 24) == generate(smollm2_float32["panel"], prompts, 24)


@needs_amx
def test_a_weight_one_ulp_off_its_blocks_keeps_its_kernel(smollm2, single_thread,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_CPU_LINEAR", "aten")  # dense weights to nudge, no block kernel yet
    engine = Engine(EngineConfig(model=SMOLLM2, device="cpu", dtype="float32", adaptive_threads=False))
    try:
        model = engine.model_runner.model
        weight = model.model.layers[3].mlp.down_proj.weight.data
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
        assert pack_exact_blocks(model, gguf_source(SMOLLM2)) == 119
        assert model.model.layers[3].mlp.down_proj.packed is None
        assert isinstance(model.model.layers[2].mlp.down_proj.packed, ExactBlockLinear)
        assert model.model.layers[2].mlp.down_proj.weight.numel() == 0  # the codes replace the dense copy
    finally:
        engine.close()


def test_embeddings_add_bf16x3_beside_the_blocks(smollm2_float32) -> None:
    """float32_matmul_precision "auto": embeddings run bf16x3 (its GEMM is faster at 1000s of rows) over
    the blocks' exact weight; generation keeps the blocks."""
    runner = smollm2_float32["auto"].model_runner
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    vectors = torch.tensor(runner.embed([[5, 9, 2, 7, 11, 3], [8, 1, 4]]))
    assert isinstance(qkv.packed, ExactBlockLinear) and isinstance(qkv.packed_high, amx_linear.AmxLinear)
    assert qkv.packed.weight().shape == (qkv.packed_high.out_features, qkv.packed_high.in_features)
    assert vectors.shape == (2, runner.model.config.hidden_size)
    assert torch.isfinite(vectors).all()


def test_the_files_blocks_are_cached_and_a_damaged_cache_is_read_again(
        smollm2_float32, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path))
    model, source = smollm2_float32["auto"].model_runner.model, gguf_source(SMOLLM2)
    first = layer_blocks(source, model)
    (cached,) = (tmp_path / "gguf_blocks").glob("*.safetensors")
    assert len(first) == 120
    second = layer_blocks(source, model)
    assert second.keys() == first.keys()
    assert all(torch.equal(second[k].codes, first[k].codes) and torch.equal(second[k].m, first[k].m)
               for k in first)
    cached.write_bytes(cached.read_bytes()[:1000])  # a cache cut short (a full disk, a killed writer)
    third = layer_blocks(source, model)
    assert "unreadable" in caplog.text and third.keys() == first.keys()
    assert cached.stat().st_size > 1000  # written again whole


def test_a_cache_that_cannot_be_written_costs_only_the_cache(
        smollm2_float32, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(blocker / "cache"))  # mkdir fails: NotADirectoryError
    found = layer_blocks(gguf_source(SMOLLM2), smollm2_float32["auto"].model_runner.model)
    assert len(found) == 120 and "could not cache them" in caplog.text
    assert blocker.read_text() == "not a directory"


def test_the_blocks_are_kept_only_where_embeddings_may_want_bf16x3(smollm2_float32) -> None:
    qkv = smollm2_float32["auto"].model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.packed, ExactBlockLinear) and qkv.packed.weight() is not None  # "auto"
    assert ExactBlockLinear(random_q4(32, 64, seed=13), None, EXT).weight() is None  # default: codes only


@needs_amx
def test_high_keeps_the_blocks_and_runs_the_head_in_bf16x3(smollm2, single_thread) -> None:
    engine = Engine(EngineConfig(model=SMOLLM2, device="cpu", dtype="float32", adaptive_threads=False,
                                 float32_matmul_precision="high"))
    try:
        model = engine.model_runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv.packed, ExactBlockLinear) and qkv.packed.weight() is None
        assert isinstance(model.lm_head.packed, amx_linear.AmxLinear)
        (tokens,) = generate(engine, ["The capital of France is"], 8)
        assert len(tokens) == 8
    finally:
        engine.close()
