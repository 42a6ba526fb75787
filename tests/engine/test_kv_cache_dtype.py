"""Quantized KV cache (EngineConfig.kv_cache_dtype): round trips, greedy agreement, the config's errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.kv_cache_dtypes import KV_CACHE_AUTO_CPU_QUANTIZED
from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.kv_quant import FORMATS, dequantize, kv_cache_format, quantize
from batchinfer.engine.worker.model_runner import ModelRunner
from tests.fixtures.tiny_models import training_sentences

# Worst error of one value as a share of its (token, head) row's max |x|: bf16 and fp8 round the mantissa
# (8 and 4 bits), int8 rounds to max/127 steps (half a step), u8 to (max - min)/255 steps.
ROUND_TRIP_BOUND = {"bf16": 2**-8, "fp8_e4m3": 2**-4, "int8": 0.5 / 127 + 1e-6, "u8": 1.0 / 255 + 1e-6}
QUANTIZED = ("bf16", "fp8_e4m3", "int8", "u8")
# Share of greedy tokens equal to the fp32 cache's (positionally: a sequence's tokens after its first
# divergence count as misses). fp8 keeps 3 mantissa bits (up to 6% per value): the random tiny model's
# near-tie logits flip at its first token on ~40% of prompts, so its bound is a floor that a wrong store
# (garbage keys: ~0 agreement) still fails; its quality figure is SmolLM2's in bench/quality.py.
AGREEMENT_FLOOR = {"bf16": 0.8, "fp8_e4m3": 0.15, "int8": 0.7, "u8": 0.8}


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_within_the_quantization_error(name: str) -> None:
    x = torch.randn(64, 3, 64) * torch.linspace(0.1, 8, 64).view(64, 1, 1)  # rows of many magnitudes
    fmt = FORMATS[name]
    codes, params = quantize(x, fmt)
    assert codes.dtype == fmt.storage
    back = dequantize(codes, params, fmt, torch.float32)
    row_max = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= ROUND_TRIP_BOUND[name] * row_max).all()


@pytest.mark.parametrize("value", ["fp16", "int4", "", 8])
def test_invalid_value_names_the_field(value: object) -> None:
    with pytest.raises(ValueError,
                       match="kv_cache_dtype: must be one of auto, fp32, bf16, fp8_e4m3, int8, u8"):
        EngineConfig(model="m", kv_cache_dtype=value)  # type: ignore[arg-type]


def test_quantized_cache_refused_on_cuda() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' runs on CPU only"):
        EngineConfig(model="m", kv_cache_dtype="int8", device="cuda")


def test_uint8_is_u8() -> None:
    assert EngineConfig(model="m", kv_cache_dtype="uint8").kv_cache_dtype == "u8"


def _prompts() -> list[str]:
    rng = random.Random(1)
    sentences = training_sentences(100, seed=7)
    base = [" ".join(rng.sample(sentences, rng.randint(1, 5))) for _ in range(10)]
    return base + [base[0] + " then " + s for s in sentences[:3]]  # shared prefixes: prefix-cache hits


def _greedy(path: Path, kv_cache_dtype: str) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params)]
    llm.close()
    return outputs


def test_greedy_agrees_with_the_fp32_cache(tiny_llama: Path) -> None:
    reference = _greedy(tiny_llama, "auto")
    for name in QUANTIZED:
        outputs = _greedy(tiny_llama, name)
        same = sum(a == b for a, b in zip(reference, outputs, strict=True) for a, b in zip(a, b, strict=True))
        total = sum(len(r) for r in reference)
        assert same >= AGREEMENT_FLOOR[name] * total, (name, same, total)


@pytest.mark.parametrize("name", ["int8", "u8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_writes_the_codes_of_the_torch_quantize(name: str, dtype: torch.dtype) -> None:
    """csrc's store_kv_quantized_ (the native step's and the fused path's store) equals kv_quant.quantize bit
    for bit, through the rows a step stores (store_rows) and hostile rows: all zeros, constant, huge."""
    ext = cpu_attention.load()
    if ext is None:
        pytest.skip("native CPU extension not built here")
    fmt = FORMATS[name]
    torch.manual_seed(0)
    qkv = (torch.randn(10, 5, 3, 16) * torch.logspace(-3, 3, 10).view(10, 1, 1, 1)).to(dtype)
    qkv[0, 2] = 0.0
    qkv[1, 2] = 0.75
    qkv[2, 2, :, :8] = -3e38 if dtype == torch.float32 else -3e36
    k, v = qkv[:, 2], qkv[:, 3]  # strided token rows, as narrowed from a step's qkv output
    codes = [torch.zeros(4, 4, 3, 16, dtype=fmt.storage) for _ in range(2)]
    params = [torch.zeros(4, 4, 3, fmt.num_params) for _ in range(2)]
    slots, rows = torch.tensor([13, 0, 7, 4, 9, 15]), torch.tensor([0, 1, 2, 9, 5, 3])
    ext.store_kv_quantized_(k, v, *codes, *params, slots, rows)
    for x, got_codes, got_params in ((k, codes[0], params[0]), (v, codes[1], params[1])):
        want_codes, want_params = quantize(x.index_select(0, rows), fmt)
        assert want_params is not None
        assert torch.equal(got_codes.view(-1, 3, 16)[slots], want_codes)
        assert torch.equal(got_params.view(-1, 3, fmt.num_params)[slots], want_params)
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[slots] = False
        assert not got_codes.view(-1, 3, 16)[untouched].any()


def test_native_store_refuses_a_slot_outside_the_cache_before_writing() -> None:
    ext = cpu_attention.load()
    if ext is None:
        pytest.skip("native CPU extension not built here")
    k = torch.randn(2, 3, 16)
    codes = [torch.zeros(4, 4, 3, 16, dtype=torch.uint8) for _ in range(2)]
    params = [torch.zeros(4, 4, 3, 2) for _ in range(2)]
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        ext.store_kv_quantized_(k, k, *codes, *params, torch.tensor([3, 16]), None)
    assert not any(c.any() for c in codes) and not any(p.any() for p in params)
    with pytest.raises(RuntimeError, match=r"params \[blocks, block_size, Hkv, 1 \(int8\) or 2 \(uint8\)\]"):
        ext.store_kv_quantized_(k, k, *codes, params[0][..., :1], params[1][..., :1], torch.tensor([0, 1]),
                                None)


def test_auto_is_u8_for_a_bf16_model_or_int8_weights_on_cpu() -> None:
    """The measured default (KV_CACHE_AUTO_CPU_QUANTIZED), resolved from the config alone so that every rank
    and the result-cache key agree; float32 keeps the model dtype, and an explicit quantized value is kept."""
    def resolved(**kwargs: str) -> str:
        return EngineConfig(model="m", device="cpu", **kwargs).resolved_kv_cache_dtype()

    assert resolved(dtype="bfloat16") == KV_CACHE_AUTO_CPU_QUANTIZED == "u8"
    assert resolved(dtype="float32") == "auto"
    assert resolved(dtype="float32", quantization="int8") == "u8"
    assert resolved(quantization="int8") == "u8"
    for explicit in ("int8", "fp8_e4m3", "u8"):
        assert resolved(dtype="bfloat16", kv_cache_dtype=explicit) == explicit
    for explicit in ("bf16", "int8", "fp8_e4m3"):
        assert resolved(quantization="int8", kv_cache_dtype=explicit) == explicit
    # the model dtype's own cache, however named, is auto's (one result-cache key)
    assert resolved(dtype="bfloat16", kv_cache_dtype="bf16") == "auto"
    assert resolved(quantization="int8", kv_cache_dtype="fp32") == "auto"
    assert resolved(dtype="float32", kv_cache_dtype="fp32") == "auto"


def test_int8_weights_take_float32_activations_on_cpu() -> None:
    """dtype "auto" under int8 weights is float32 on every CPU (the int8 GEMMs read and write float32); an
    explicit dtype is kept."""
    assert EngineConfig(model="m", device="cpu", quantization="int8").resolved_dtype_name() == "float32"
    assert EngineConfig(model="m", device="cpu", quantization="int8",
                        dtype="bfloat16").resolved_dtype_name() == "bfloat16"


@pytest.mark.parametrize(("dtype", "kv_cache_dtype", "want"),
                         [("bfloat16", "auto", "u8"), ("bfloat16", "bf16", None), ("float32", "auto", None),
                          ("float32", "fp32", None)])
def test_the_runner_resolves_auto(tiny_llama: Path, dtype: str, kv_cache_dtype: str,
                                  want: str | None) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                      block_size=4, num_kv_blocks=8, device="cpu"))
    assert (runner.kv_format.name if runner.kv_format is not None else None) == want


def test_native_store_keeps_a_nan_row_nan_and_its_codes_defined() -> None:
    """A NaN K/V row reads back as NaN (its params are NaN, as torch's amax / amin make them); its codes
    are 0, not a float -> int cast of NaN."""
    ext = cpu_attention.load()
    if ext is None:
        pytest.skip("native CPU extension not built here")
    for storage, num_params in ((torch.uint8, 2), (torch.int8, 1)):
        k = torch.randn(2, 1, 16)
        k[0, 0, 5] = float("nan")
        k[1, 0, 3] = float("inf")
        codes = [torch.full((1, 2, 1, 16), 7, dtype=storage) for _ in range(2)]
        params = [torch.zeros(1, 2, 1, num_params) for _ in range(2)]
        ext.store_kv_quantized_(k, k, *codes, *params, torch.tensor([0, 1]), None)
        assert params[0][0, 0].isnan().all() and not codes[0][0, 0].any()
        # the inf row: its scale is inf, so every finite value codes to 0 and inf / inf (a NaN code) to 0
        assert not codes[0][0, 1].any()


def test_an_fp32_cache_under_a_bf16_model_names_the_choices() -> None:
    """fp32 is a float32 model's own cache (int8 weights' way out of auto's u8); under bf16 (dtype auto
    resolved to it, past the config's check of an explicit dtype) the runner's format lookup refuses it."""
    assert kv_cache_format("fp32", torch.float32) is None
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp32' is a float32 model's own cache; this model "
                                         r"runs bfloat16: use auto, bf16, int8, u8 or fp8_e4m3"):
        kv_cache_format("fp32", torch.bfloat16)


def test_an_fp32_cache_under_an_explicit_bf16_dtype_is_refused_with_the_config() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp32' is a float32 model's own cache; got dtype "
                                         r"'bfloat16': use auto, bf16, int8, u8 or fp8_e4m3"):
        EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="fp32")
