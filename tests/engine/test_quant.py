"""quantization="int8" (int8 weights, fbgemm dynamic int8 GEMMs on CPU): runs, tracks fp32, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.config import Settings
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.weight_packing import int8_linear
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
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])  # untied head + no bias; tied head + qkv bias
def test_int8_runner_tracks_fp32(request, name: str, dtype: str) -> None:
    """Prefill and decode logits of an int8 runner stay close to fp32 (log-probs, teacher-forced)."""
    path: Path = request.getfixturevalue(name)
    quant = make_runner(path, dtype=dtype, quantization="int8")
    fp32 = make_runner(path, dtype="float32")
    assert quant.model.model.layers[0].mlp.gate_up_proj.packed is not None
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
    with pytest.raises(ValueError, match=r"quantization: must be None or one of int8; got 'int4'"):
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
