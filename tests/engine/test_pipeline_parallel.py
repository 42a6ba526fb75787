"""Pipeline parallelism on CPU (gloo, fp32): stages of layers must generate exactly what one rank generates.

The tiny models have 2 layers, so PP=2 puts one layer on each stage (the first embeds, the last holds the
final norm and the LM head; tiny_qwen2's last stage keeps the tied embedding table as its head). Every
pipeline engine is closed at the end of its test, and the test checks that its rank processes are gone.
Each rank runs one torch thread (tests/conftest.py), so PP=2 x TP=2 is 4 single-threaded processes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.model_files import load_hf_config
from batchinfer.engine.models.llama import LlamaForCausalLM
from batchinfer.engine.models.loader import load_weights
from batchinfer.engine.models.pipeline_stage import split_layers
from batchinfer.engine.parallel.distributed import CMD_EXIT, CMD_STEP, tp_world_size
from batchinfer.engine.parallel.pp_runner import PipelineParallelRunner, split_micro_batches
from batchinfer.engine.parallel.pp_stage import HEADER_WORDS, WIRE_DTYPES, header
from tests.engine.test_tensor_parallel import GREEDY, PREEMPTING, generate, shared_prefix_prompts

pytestmark = pytest.mark.integration  # every engine here starts rank processes


def generate_split(path: Path, prompts: list[str], params: SamplingParams, **kwargs) -> tuple[list, LLM]:
    """Like generate, but every step of the pipeline is split into micro-batches (even one decode token
    per sequence), so the overlap path runs at every step."""
    llm = LLM(str(path), device="cpu", dtype="float32", **kwargs)
    try:
        llm.engine.model_runner.min_micro_batch_tokens = 1
        outputs = llm.generate(prompts, params)
        assert llm.engine.block_manager.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outputs], llm
    finally:
        llm.close()


def assert_pipeline_closed(llm: LLM) -> None:
    """The pipeline engine's ranks have exited cleanly and this process left the process group."""
    runner = llm.engine.model_runner
    assert isinstance(runner, PipelineParallelRunner)
    assert runner.closed and runner.launcher.processes
    assert all(not p.is_alive() and p.exitcode == 0 for p in runner.launcher.processes)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_pp2_equals_pp1_with_preemption_and_prefix_hits(request, model: str) -> None:
    path = request.getfixturevalue(model)
    prompts = shared_prefix_prompts()
    expected, single = generate(path, prompts, GREEDY, **PREEMPTING)
    got, pipeline = generate_split(path, prompts, GREEDY, pipeline_parallel_size=2, **PREEMPTING)
    assert got == expected
    assert_pipeline_closed(pipeline)
    for llm in (single, pipeline):
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0, "the scenario must preempt"
        assert stats.prefix_cache_hits > 0, "the scenario must hit the prefix cache"
    assert pipeline.engine.block_manager.num_total_blocks == PREEMPTING["num_kv_blocks"]


def test_pp2_chunked_prefill_equals_pp1(tiny_llama) -> None:
    prompts = shared_prefix_prompts(20)
    options = {"max_num_batched_tokens": 32}  # long prompts are prefilled in chunks mixed with decodes
    expected, _ = generate(tiny_llama, prompts, GREEDY, **options)
    got, pipeline = generate(tiny_llama, prompts, GREEDY, pipeline_parallel_size=2, **options)
    assert got == expected
    assert_pipeline_closed(pipeline)


def test_tp2_x_pp2_equals_one_rank_with_preemption_prefix_hits_and_chunks(tiny_qwen2) -> None:
    """4 ranks: each stage's two ranks split the heads, and their all-reduces stay inside the stage."""
    prompts = shared_prefix_prompts()
    options = {**PREEMPTING, "max_num_batched_tokens": 24}
    expected, _ = generate(tiny_qwen2, prompts, GREEDY, **options)
    got, pipeline = generate_split(tiny_qwen2, prompts, GREEDY, pipeline_parallel_size=2,
                                   tensor_parallel_size=2, **options)
    assert got == expected
    assert len(pipeline.engine.model_runner.launcher.processes) == 3
    assert_pipeline_closed(pipeline)
    assert tp_world_size() == 1
    stats = pipeline.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_each_stage_holds_only_its_weights(request, model: str) -> None:
    """Parameter counts: the stages together hold the model once (a tied head: the table twice)."""
    path = request.getfixturevalue(model)
    config = load_hf_config(path)

    def count(stage=None) -> tuple[int, set[str]]:
        module = LlamaForCausalLM(config, 64, stage=stage)
        load_weights(module, path)  # a stage reads only its own tensors; all of them must be there
        names = {name for name, _ in module.named_parameters()}
        return sum(p.numel() for p in module.parameters()), names

    whole, _ = count()
    (first, first_names), (last, last_names) = (count(split_layers(2, 2, s)) for s in (0, 1))
    assert all(".layers.1." not in n for n in first_names) and all(".layers.0." not in n for n in last_names)
    assert "model.embed_tokens.weight" in first_names and "model.norm.weight" not in first_names
    assert "model.norm.weight" in last_names
    table = config.vocab_size * config.hidden_size
    assert first < whole and last < whole
    assert first + last == whole + (table if config.tie_word_embeddings else 0)


def test_rank0_kv_cache_holds_only_its_layers(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", pipeline_parallel_size=2, num_kv_blocks=16)
    try:
        runner = llm.engine.model_runner
        assert runner.runner.kv_cache.shape[0] == 1  # [layers, 2, blocks, ...]: stage 0 has one layer
        assert runner.num_kv_blocks == 16
    finally:
        llm.close()
    assert_pipeline_closed(llm)


def test_micro_batches_are_contiguous_and_balanced_by_tokens() -> None:
    assert split_micro_batches([1] * 8, 2) == [(0, 4), (4, 8)]
    assert split_micro_batches([100, 1, 1], 2) == [(0, 1), (1, 3)]
    assert split_micro_batches([1, 1, 100], 2) == [(0, 2), (2, 3)]
    assert split_micro_batches([5], 4) == [(0, 1)]
    assert split_micro_batches([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]


def test_header_announces_the_rows_and_dtype_of_the_hidden_states_it_precedes() -> None:
    """The receiver allocates what the header says, so gloo never sees a message larger than its buffer
    (it would std::terminate the receiving rank: SIGABRT, no message)."""
    hidden = torch.zeros(77, 64, dtype=torch.bfloat16)
    assert header(CMD_STEP, 120, hidden).tolist() == [CMD_STEP, 120, 77, WIRE_DTYPES.index(torch.bfloat16)]
    assert header(CMD_EXIT).tolist() == [CMD_EXIT, 0, 0, 0]
    assert header(CMD_STEP, 5).numel() == HEADER_WORDS


def test_more_stages_than_layers_is_a_clear_error(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: 3 stages need at least .* has 2"):
        LLM(str(tiny_llama), device="cpu", pipeline_parallel_size=3)
    assert not torch.distributed.is_initialized()


def test_invalid_settings_rejected_by_config(tiny_llama) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(str(tiny_llama), device="cpu", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend: must be one of mp, ray"):
        LLM(str(tiny_llama), device="cpu", distributed_executor_backend="mpi")


def test_worker_settings_carry_the_parallel_layout() -> None:
    from batchinfer.config import Settings

    kwargs = Settings(pipeline_parallel_size=2, distributed_executor_backend="ray").engine_kwargs()
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "ray"


def test_killed_rank_fails_the_step_naming_it(tiny_llama) -> None:
    """SIGKILL the last stage mid-generation: the next step raises within seconds, never hangs."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", pipeline_parallel_size=2)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for i, prompt in enumerate(shared_prefix_prompts(4)):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            engine.step()
        rank1 = engine.model_runner.launcher.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(stage 1, tp rank 0\) \(exit code -9\) died"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(RankFailedError):  # the engine stays failed
            engine.step()
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_smollm2_pp2_equals_pp1(smollm2) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = {"max_model_len": 128, "num_kv_blocks": 32}
    expected, _ = generate(smollm2, prompts, params, **options)
    got, pipeline = generate(smollm2, prompts, params, pipeline_parallel_size=2, **options)
    assert got == expected
    assert_pipeline_closed(pipeline)
