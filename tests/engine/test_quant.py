"""quantization="int8" (int8 weights, dynamic int8 GEMMs on CPU: fbgemm, oneDNN's on AMX): runs, tracks fp32,
clear errors; its activation smoothing keeps the float function and brings int8 closer to it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from batchinfer.config import Settings
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers import int8_smoothing, weight_packing
from batchinfer.engine.layers.context import AttentionContext, set_context
from batchinfer.engine.layers.quantization import quantization_format
from batchinfer.engine.layers.weight_packing import INT8_GEMM_ENV, int8_gemm_engine, int8_linear
from tests.engine.test_models import FakeSeq, ScatteredBlocks, make_runner, random_tokens, run_step

needs_fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                  reason="this torch build has no fbgemm")


@needs_fbgemm
def test_int8_linear_is_close_to_the_float_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=gen) * 0.1, torch.randn(48, generator=gen)
    x = torch.randn(7, 64, generator=gen)
    expected = torch.nn.functional.linear(x, weight, bias)
    out = int8_linear(weight, bias)(x)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert float((out - expected).abs().max()) < 0.02 * float(expected.abs().max())
    assert int8_linear(weight, None)(x.bfloat16()).dtype == torch.bfloat16  # output in the input's dtype


@needs_fbgemm
@pytest.mark.parametrize("engine", ["fbgemm", "onednn"])
@pytest.mark.parametrize("per_token", [False, True])
def test_both_int8_engines_quantize_the_same_way(monkeypatch: pytest.MonkeyPatch, engine: str,
                                                 per_token: bool) -> None:
    """A weight packed for oneDNN (the AMX default) gives fbgemm's result up to summation order: the same
    per-channel weights, the same per-tensor activation quantization; packing leaves torch's engine as it
    was."""
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"this torch build has no {engine}")
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 64, generator=gen) * 0.1, torch.randn(96, generator=gen)
    x = torch.randn(11, 64, generator=gen)
    x[:, 5] *= 30  # an outlier channel sets the per-tensor activation step
    monkeypatch.setenv(INT8_GEMM_ENV, "fbgemm")
    reference = int8_linear(weight, bias, per_token=per_token)(x)
    engine_before = torch.backends.quantized.engine
    monkeypatch.setenv(INT8_GEMM_ENV, engine)
    out = int8_linear(weight, bias, per_token=per_token)(x)
    assert torch.backends.quantized.engine == engine_before
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-4 * float(reference.abs().max()))


def test_the_int8_engine_is_onednn_only_on_amx_and_a_bad_value_names_the_choices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INT8_GEMM_ENV, raising=False)
    onednn_built = "onednn" in torch.backends.quantized.supported_engines
    for flags, want in [(frozenset({"avx512f", "avx512_vnni", "amx_tile", "amx_int8"}),
                         "onednn" if onednn_built else "fbgemm"),
                        (frozenset({"avx512f", "avx512_vnni"}), "fbgemm"), (frozenset({"avx2"}), "fbgemm")]:
        monkeypatch.setattr(weight_packing, "cpu_flags", lambda flags=flags: flags)
        assert int8_gemm_engine() == want, flags
    monkeypatch.setenv(INT8_GEMM_ENV, "fbgemm")
    assert int8_gemm_engine() == "fbgemm"
    monkeypatch.setenv(INT8_GEMM_ENV, "qnnpack")
    with pytest.raises(ValueError, match=r"BATCHINFER_CPU_INT8_GEMM must be one of auto, fbgemm, onednn; "
                                         r"got 'qnnpack'"):
        int8_gemm_engine()


@needs_fbgemm
def test_per_token_int8_linear_keeps_an_outlier_row_from_spoiling_the_others() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(48, 64, generator=gen) * 0.1, torch.randn(48, generator=gen)
    x = torch.randn(9, 64, generator=gen)
    x[0] *= 1000  # one token with massive activations, as on the first token of a Llama-family MLP
    expected = torch.nn.functional.linear(x, weight, bias)

    def error_of_the_other_rows(out: torch.Tensor) -> float:
        return float((out[1:] - expected[1:]).abs().max() / expected[1:].abs().max())

    per_token = int8_linear(weight, bias, per_token=True)(x)
    assert error_of_the_other_rows(per_token) < 0.02
    assert error_of_the_other_rows(per_token) < 0.1 * error_of_the_other_rows(int8_linear(weight, bias)(x))
    assert float((per_token[0] - expected[0]).abs().max()) < 0.02 * float(expected[0].abs().max())


@needs_fbgemm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])  # untied head + no bias; tied head + qkv bias
def test_int8_runner_tracks_fp32(request, name: str, dtype: str) -> None:
    """Prefill and decode logits of an int8 runner stay close to fp32 (log-probs, teacher-forced)."""
    path: Path = request.getfixturevalue(name)
    # the weights alone: a cache of the model dtype (auto is u8 under int8 weights on CPU)
    model_cache = "fp32" if dtype == "float32" else "bf16"
    quant = make_runner(path, dtype=dtype, quantization="int8", kv_cache_dtype=model_cache)
    fp32 = make_runner(path, dtype="float32")
    assert quant.model.model.layers[0].mlp.gate_up_proj.packed is not None and quant.kv_format is None
    # The runner smoothed (the norm weights carry the 1 / s); fp32 kept the checkpoint's.
    norm_weights = [r.model.model.layers[0].input_layernorm.weight.float() for r in (quant, fp32)]
    assert not torch.allclose(*norm_weights)
    vocab = fp32.hf_config.vocab_size
    prompts = [random_tokens(vocab, n + 5, seed=60 + n) for n in (4, 13)]
    results = []
    for runner in (quant, fp32):
        pool = ScatteredBlocks(runner.num_kv_blocks, runner.block_size, seed=6)
        seqs = [FakeSeq(p) for p in prompts]
        steps = [run_step(runner, pool, [(s, len(s.token_ids) - 5) for s in seqs])]
        steps += [run_step(runner, pool, [(s, 1) for s in seqs]) for _ in range(5)]
        results.append([torch.log_softmax(step.float(), dim=-1) for step in steps])
    for low, ref in zip(*results, strict=True):
        kl = (ref.exp() * (ref - low)).sum(dim=-1)
        assert float(kl.max()) < 0.05, f"int8 drifted from fp32: KL {kl.tolist()}"


@needs_fbgemm
def test_int8_llm_generates(make_llm, tiny_llama: Path) -> None:
    from batchinfer.engine.sampling_params import SamplingParams

    llm = make_llm(tiny_llama, quantization="int8", num_kv_blocks=32)
    out = llm.generate(["Hello there", "The cat"], SamplingParams(temperature=0.0, max_tokens=6))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_bad_quantization_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"quantization: must be None or one of int8, gguf; got 'int4'"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="runs on CPU only"):
        EngineConfig(model="m", device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="quantization"):
        Settings(quantization="fp4")
    assert Settings(quantization="int8").engine_kwargs()["quantization"] == "int8"


def test_worker_command_has_dtype_and_quantization_options(monkeypatch, tmp_path: Path) -> None:
    """`batchinfer worker --dtype ... --quantization int8`: the options exist and refuse other values."""
    from click.testing import CliRunner

    from batchinfer.cli.worker_cmd import worker

    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    result = CliRunner().invoke(worker, ["--dtype", "bogus"])
    assert result.exit_code != 0 and "bogus" in result.output
    result = CliRunner().invoke(worker, ["--quantization", "int4"])
    assert result.exit_code != 0 and "int4" in result.output


def _load_float_model(path: Path) -> torch.nn.Module:
    """The tiny model with its weights loaded and nothing packed (what pack_weights receives)."""
    from batchinfer.engine.model_files import load_hf_config
    from batchinfer.engine.models import get_model_class
    from batchinfer.engine.models.loader import load_weights

    hf_config = load_hf_config(path)
    model = get_model_class(hf_config)(hf_config, 128)
    load_weights(model, path)
    return model.eval()


@torch.inference_mode()
def _dense_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    empty = torch.empty(0, dtype=torch.int32)
    set_context(AttentionContext(empty, empty, empty, empty, len(ids), len(ids), "dense"))
    try:
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
    finally:
        set_context(None)
    return model.compute_logits(hidden).float()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])  # untied head + no bias; tied head + qkv bias
def test_smoothing_keeps_the_float_function(request, name: str) -> None:
    """Folded into norms, v rows and up rows, smoothing changes the float logits by rounding only."""
    path: Path = request.getfixturevalue(name)
    model = _load_float_model(path)
    vocab = model.config.vocab_size
    ids = random_tokens(vocab, 24, seed=3)
    expected = _dense_logits(model, ids)
    calibration = int8_smoothing.calibration_token_ids(path, 128)
    assert len(calibration) >= 2 and all(0 < len(c) <= 128 for c in calibration)  # cut to the context
    assert int8_smoothing.smoothing_applies(model)
    assert int8_smoothing.smooth_for_int8(model, calibration) == 4 * model.config.num_hidden_layers
    smoothed = _dense_logits(model, ids)
    assert float((smoothed - expected).abs().max()) <= 1e-4 * float(expected.abs().max())


def _inject_outlier_channels(model: torch.nn.Module, factor: float = 64.0) -> None:
    """Make one input channel of qkv_proj and gate_up_proj an outlier without changing the float function.

    The norm weight of channel j grows by `factor` and the weight column j of its linear shrinks by it, as
    trained Llama-family models have a few norm channels far larger than the rest.
    """
    for index, layer in enumerate(model.model.layers):
        for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                             (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
            channel = (7 + 11 * index) % norm.weight.numel()
            norm.weight.data[channel] *= factor
            linear.weight.data[:, channel] /= factor


@needs_fbgemm
def test_smoothing_brings_int8_closer_to_float_with_outlier_channels(tiny_llama: Path) -> None:
    model = _load_float_model(tiny_llama)
    _inject_outlier_channels(model)
    ids = random_tokens(model.config.vocab_size, 32, seed=4)
    reference = torch.log_softmax(_dense_logits(model, ids), dim=-1)
    plain, smoothed = copy.deepcopy(model), copy.deepcopy(model)
    int8_smoothing.smooth_for_int8(smoothed, int8_smoothing.calibration_token_ids(tiny_llama, 128))
    kls = []
    for quantized in (plain, smoothed):
        quantization_format("int8").pack_linears(quantized)
        low = torch.log_softmax(_dense_logits(quantized, ids), dim=-1)
        kls.append(float((reference.exp() * (reference - low)).sum(dim=-1).mean()))
    plain_kl, smoothed_kl = kls
    assert smoothed_kl < 0.5 * plain_kl, f"smoothing did not help: KL {plain_kl:.5f} -> {smoothed_kl:.5f}"


def test_smoothing_is_skipped_under_tensor_parallelism(monkeypatch, tiny_llama: Path) -> None:
    model = _load_float_model(tiny_llama)
    assert int8_smoothing.smoothing_applies(model)
    monkeypatch.setattr(int8_smoothing, "tp_world_size", lambda: 2)
    assert not int8_smoothing.smoothing_applies(model)
