"""Tensor parallelism on CPU (gloo, fp32): N ranks must generate exactly what one rank generates.

The tiny models have 4 query heads and 2 KV heads, so tp=2 splits the KV heads and tp=4 replicates them;
SmolLM2 (9 query heads, 3 KV heads, 30 layers) runs with tp=3. Every TP engine is closed at the end of its
test, and the test checks that its worker processes are gone and that this process is a single rank again.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.parallel.distributed import tp_world_size
from tests.fixtures.tiny_models import training_sentences

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def shared_prefix_prompts(count: int = 14) -> list[str]:
    """Prompts of a few to ~60 tokens; half of them extend one long common prefix (prefix-cache hits)."""
    rng = random.Random(3)
    sentences = training_sentences(100, seed=7)
    prefix = " ".join(sentences[:4])
    own = [" ".join(rng.sample(sentences, rng.randint(1, 4))) for _ in range(count // 2)]
    return own + [f"{prefix} {s}" for s in sentences[10 : 10 + count - len(own)]]


def generate(path: Path, prompts: list[str], params: SamplingParams, **kwargs) -> tuple[list[list[int]], LLM]:
    """Token ids of each prompt's completion, and the (closed) LLM for its stats."""
    llm = LLM(str(path), device="cpu", dtype="float32", **kwargs)
    try:
        outputs = llm.generate(prompts, params)
        assert not llm.engine.has_unfinished()
        assert llm.engine.block_manager.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outputs], llm
    finally:
        llm.close()


def assert_closed(llm: LLM) -> None:
    """The TP engine's workers have exited and this process left the process group."""
    runner = llm.engine.model_runner
    assert runner.closed and runner.workers
    assert all(not p.is_alive() and p.exitcode == 0 for p in runner.workers)
    assert tp_world_size() == 1


# Small KV pool (block_size 4): the batch outgrows it, so sequences are preempted and recomputed.
PREEMPTING = {"num_kv_blocks": 24, "block_size": 4, "max_num_seqs": 8}


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_tp2_equals_tp1_with_preemption_and_prefix_hits(request, model: str) -> None:
    path = request.getfixturevalue(model)
    prompts = shared_prefix_prompts()
    expected, single = generate(path, prompts, GREEDY, **PREEMPTING)
    got, parallel = generate(path, prompts, GREEDY, tensor_parallel_size=2, **PREEMPTING)
    assert got == expected
    assert_closed(parallel)
    for llm in (single, parallel):
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0, "the scenario must preempt"
        assert stats.prefix_cache_hits > 0, "the scenario must hit the prefix cache"
    # Same block ids on every rank: the engine's pool is rank 0's, and rank 0 holds the configured count.
    assert parallel.engine.block_manager.num_total_blocks == PREEMPTING["num_kv_blocks"]


def test_tp2_roomy_batch_with_chunked_prefill_equals_tp1(tiny_llama) -> None:
    prompts = shared_prefix_prompts(20)
    options = {"max_num_batched_tokens": 32}  # long prompts are prefilled in chunks mixed with decodes
    expected, _ = generate(tiny_llama, prompts, GREEDY, **options)
    got, parallel = generate(tiny_llama, prompts, GREEDY, tensor_parallel_size=2, **options)
    assert got == expected
    assert_closed(parallel)


def test_tp4_replicates_kv_heads(tiny_llama) -> None:
    """4 ranks, 2 KV heads: each KV head lives on two ranks; outputs still equal one rank's."""
    prompts = shared_prefix_prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected, _ = generate(tiny_llama, prompts, params)
    got, parallel = generate(tiny_llama, prompts, params, tensor_parallel_size=4)
    assert got == expected
    assert_closed(parallel)


@pytest.mark.parametrize("size", [3, 8])
def test_size_that_does_not_split_the_heads_is_a_clear_error(tiny_llama, size: int) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size: .*use one of \[1, 2, 4\]"):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=size)
    assert tp_world_size() == 1


def test_more_ranks_than_cuda_devices_is_a_clear_error(tiny_llama) -> None:
    visible = torch.cuda.device_count()
    says = rf"tensor_parallel_size: 4 needs CUDA devices.*{visible} are visible"
    if not torch.backends.cuda.is_built():  # a CPU torch is refused before the ranks are counted
        says = r"is a CPU build without CUDA; use --device cpu"
    with pytest.raises(ValueError, match=says):
        LLM(str(tiny_llama), device=f"cuda:{max(visible - 1, 0)}", tensor_parallel_size=4)


def test_invalid_size_rejected_by_config(tiny_llama) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=0)


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2) -> None:
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "Three reasons to learn Python:",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    options = {"max_model_len": 256, "num_kv_blocks": 64}
    expected, _ = generate(smollm2, prompts, params, **options)
    got, parallel = generate(smollm2, prompts, params, tensor_parallel_size=3, **options)
    assert got == expected
    assert_closed(parallel)
