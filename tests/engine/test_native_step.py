"""The native CPU step (worker/native_step.py, csrc/decoder_stack.cpp) against the Python layer loop it
replaces: the same logits and the same KV cache, step by step, through prefill, mixed and decode steps,
in float32, bfloat16 and int8, over caches of the model dtype and of int8 / u8 codes; and the cases that keep
the Python loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers import cpu_attention, weight_packing
from batchinfer.engine.worker import native_step
from batchinfer.engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="native CPU extension not built here")


class Seq:
    """The three Sequence fields the runner reads."""

    def __init__(self, token_ids: list[int], block_table: list[int], num_computed_tokens: int = 0) -> None:
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_computed_tokens = num_computed_tokens


def _runner(model: Path, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model), dtype=dtype, quantization=quantization, block_size=4,
                                    num_kv_blocks=32, device="cpu", kv_cache_dtype=kv_cache_dtype))


def _schedule() -> list[list[tuple[int, int]]]:
    """Per step, (sequence, new tokens): a prefill, a mixed step (a decode beside a prefill chunk and a new
    prompt), then decode-only steps."""
    return [[(0, 6)], [(0, 1), (1, 5), (2, 3)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)],
            [(1, 1), (2, 1)]]


def _run(runner: ModelRunner) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of every step of _schedule (greedy tokens appended) and the KV cache after the last (a quantized
    cache: its codes)."""
    vocab = runner.hf_config.vocab_size
    seqs = [Seq([(7 * i + 3 * j) % vocab for j in range(6 + i)], list(range(8 * i, 8 * i + 8)))
            for i in range(3)]
    logits = []
    for step in _schedule():
        scheduled = [(seqs[s], n) for s, n in step]
        out = runner.execute_model(scheduled)
        logits.append(out)
        for (seq, n), row in zip(scheduled, out, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(int(row.argmax()))
    assert runner.kv_cache is not None
    return logits, runner.kv_cache.clone()


@pytest.mark.parametrize(("dtype", "quantization", "linear"),
                         [("float32", None, "onednn"), ("bfloat16", None, "onednn"),
                          ("float32", "int8", "auto"),
                          ("float32", None, "panel"), ("bfloat16", None, "panel")])
def test_native_step_equals_the_python_layer_loop(tiny_llama: Path, dtype: str, quantization: str | None,
                                                  linear: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if linear == "panel" and weight_packing.panel_extension() is None:
        pytest.skip("the panel GEMM needs an AVX2 + FMA build")
    monkeypatch.setenv(weight_packing.CPU_LINEAR_ENV, linear)
    plain = "bf16" if dtype == "bfloat16" else "fp32"  # the model dtype's cache (auto: u8 under bf16 / int8)
    native = _runner(tiny_llama, dtype, quantization, plain)
    if quantization is None:
        kind = weight_packing.PanelLinear if linear == "panel" else weight_packing.OneDnnLinear
        assert isinstance(native.model.model.layers[0].mlp.down_proj.packed, kind)
    python = _runner(tiny_llama, dtype, quantization, plain)
    assert native.native_step is not None and native.kv_format is None
    python.native_step = None
    native_logits, native_cache = _run(native)
    python_logits, python_cache = _run(python)
    for got, expected in zip(native_logits, python_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # the same kernels, in one order
    torch.testing.assert_close(native_cache, python_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "u8"])
def test_native_step_over_a_quantized_cache_equals_the_python_layer_loop(
        tiny_llama: Path, dtype: str, kv_cache_dtype: str) -> None:
    native = _runner(tiny_llama, dtype, None, kv_cache_dtype)
    python = _runner(tiny_llama, dtype, None, kv_cache_dtype)
    assert native.native_step is not None and native.kv_format is not None
    python.native_step = None
    native_logits, native_cache = _run(native)
    python_logits, python_cache = _run(python)
    for got, expected in zip(native_logits, python_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(native_cache, python_cache)  # the same codes: one store kernel
    for got_layer, want_layer in zip(native.attention_layers, python.attention_layers, strict=True):
        got, want = got_layer.quantized_kv, want_layer.quantized_kv
        assert got is not None and want is not None and got.k_params is not None and got.v_params is not None
        assert torch.equal(got.k_params, want.k_params) and torch.equal(got.v_params, want.v_params)


@pytest.mark.parametrize("engine", ["fbgemm", "onednn"])
def test_native_step_with_int8_weights_over_the_default_u8_cache_equals_the_python_layer_loop(
        tiny_llama: Path, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8's defaults (float32 activations, a u8 cache) with weights packed for either quantized engine:
    the C++ stack calls whichever packed them, as the Python loop does."""
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"this torch build has no {engine}")
    monkeypatch.setenv(weight_packing.INT8_GEMM_ENV, engine)
    native = _runner(tiny_llama, "auto", "int8")
    python = _runner(tiny_llama, "auto", "int8")
    assert native.dtype == torch.float32 and native.kv_format is not None and native.kv_format.name == "u8"
    assert isinstance(native.model.model.layers[0].mlp.down_proj.packed, weight_packing.Int8Linear)
    assert native.native_step is not None
    python.native_step = None
    native_logits, native_cache = _run(native)
    python_logits, python_cache = _run(python)
    for got, expected in zip(native_logits, python_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(native_cache, python_cache)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype", "native_attention"),
                         [("float32", "auto", True), ("bfloat16", "u8", True), ("float32", "int8", True),
                          ("float32", "bf16", False), ("bfloat16", "fp8_e4m3", False)])
def test_decode_steps_skip_the_python_attention(tiny_llama: Path, dtype: str, kv_cache_dtype: str,
                                                native_attention: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-only step runs attention in C++ over a cache it reads (the model dtype, int8 / u8 codes); a
    prefill step, or a cache it does not read, calls the Attention layer per layer."""
    runner = _runner(tiny_llama, dtype, None, kv_cache_dtype)
    assert runner.native_step is not None
    calls: list[int] = []
    attend = runner.native_step._attend

    def counted(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(i)
        return attend(i, q, k, v)

    monkeypatch.setattr(runner.native_step, "_attend", counted)
    seq = Seq([1, 2, 3, 4, 5], [0, 1])
    runner.execute_model([(seq, 5)])
    assert calls == list(range(runner.hf_config.num_hidden_layers))
    seq.num_computed_tokens, calls[:] = 5, []
    seq.token_ids.append(6)
    runner.execute_model([(seq, 1)])
    assert calls == ([] if native_attention else list(range(runner.hf_config.num_hidden_layers)))


def test_python_loop_where_the_native_step_does_not_apply(tiny_llama: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_step.NATIVE_STEP_ENV, "0")
    assert _runner(tiny_llama, "float32", None).native_step is None
    monkeypatch.delenv(native_step.NATIVE_STEP_ENV)
    monkeypatch.setattr(cpu_attention, "_FUSED_OFF", True)  # the torch-op A/B path keeps the Python loop
    assert _runner(tiny_llama, "float32", None).native_step is None
