"""The CPU step budget (worker/step_budget.py): max_num_batched_tokens cut so the MLP's gate_up output
stays within what glibc's malloc reuses; the scheduler and the embeddings forward take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from batchinfer import LLM, SamplingParams
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.worker import step_budget
from batchinfer.engine.worker.model_runner import ModelRunner
from batchinfer.engine.worker.step_budget import (
    MALLOC_REUSE_BYTES,
    MIN_CHUNK_TOKENS,
    chunk_budget,
    step_token_budget,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def test_chunks_keep_the_widest_activation_within_what_malloc_reuses() -> None:
    smollm2_fp32 = 2 * 1536 * 4  # gate_up's row: 2 x intermediate_size float32
    assert chunk_budget(4096, widest_row_bytes=smollm2_fp32) == MALLOC_REUSE_BYTES // smollm2_fp32 == 2730
    assert chunk_budget(4096, widest_row_bytes=2 * 1536 * 2) == 4096  # bf16: 5461 rows fit, the budget binds
    assert chunk_budget(4096, widest_row_bytes=2 * 14336 * 4) == 292  # an 8B model's MLP in fp32
    assert chunk_budget(4096, widest_row_bytes=2 * 53248 * 4) == MIN_CHUNK_TOKENS  # never below the floor
    assert chunk_budget(100, widest_row_bytes=2 * 53248 * 4) == 100  # nor above a smaller budget


def test_the_budget_follows_the_models_mlp_dtype_and_device() -> None:
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536)
    assert step_token_budget(4096, hf_config=smollm2, dtype=torch.float32, device=CPU) == 2730
    assert step_token_budget(4096, hf_config=smollm2, dtype=torch.bfloat16, device=CPU) == 4096
    assert step_token_budget(1024, hf_config=smollm2, dtype=torch.float32, device=CPU) == 1024
    assert step_token_budget(4096, hf_config=smollm2, dtype=torch.float32, device=CUDA) == 4096  # it caches


def test_the_scheduler_takes_the_cut_budget_and_greedy_output_is_unchanged(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 400-token prompt prefilled in chunks of the cut budget (300 tokens) generates what one step does."""
    prompt = {"prompt_token_ids": [3 + (i * 37) % 400 for i in range(400)]}
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    with LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_batched_tokens=1024) as llm:
        assert llm.engine.scheduler.max_num_batched_tokens == 1024  # tiny MLP: 1 KiB a token, nothing cut
        whole = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(step_budget, "MALLOC_REUSE_BYTES", 300 * 2 * 128 * 4)  # 300 tokens of its gate_up
    with LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_batched_tokens=1024) as llm:
        assert llm.engine.scheduler.max_num_batched_tokens == 300
        chunked = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert chunked == whole


def test_the_embeddings_forward_takes_the_cut_budget(tiny_llama: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs of 700 tokens in all, in forwards of at most 300: the vectors of one 1024-token forward."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (250, 40, 180, 230)]
    config = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_num_batched_tokens=1024,
                          num_kv_blocks=16, max_model_len=512)
    whole = ModelRunner(config)
    assert whole.step_tokens == 1024
    monkeypatch.setattr(step_budget, "MALLOC_REUSE_BYTES", 300 * 2 * 128 * 4)
    cut = ModelRunner(config)
    assert cut.step_tokens == 300
    torch.testing.assert_close(torch.tensor(cut.embed(inputs)), torch.tensor(whole.embed(inputs)),
                               atol=1e-5, rtol=1e-5)
