"""Quantized KV cache (EngineConfig.kv_cache_dtype): round trips, greedy agreement, the config's errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.kv_quant import FORMATS, dequantize, quantize
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
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, bf16, fp8_e4m3, int8, u8"):
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
