"""Batched embeddings (issue 34): packed cache-free forwards equal a per-input transformers forward, in input
order, for mixed lengths (length 1, one longer than the chunk budget); the KV cache is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.attention_plan import build_dense_groups
from batchinfer.engine.worker.embed_forward import plan_chunks
from batchinfer.engine.worker.model_runner import ModelRunner

BUDGET = 24
# Lengths 1 .. 40: several inputs per chunk, groups with padding, and one (40) longer than the budget.
LENGTHS = [7, 1, 40, 3, 12, 12, 5, 19, 2, 9, 30, 1]


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> ModelRunner:
    config = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_num_batched_tokens=BUDGET,
                          max_num_seqs=4, num_kv_blocks=16, max_model_len=128)
    return ModelRunner(config)


def _inputs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in LENGTHS]


def _reference(path: Path, inputs: list[list[int]]) -> torch.Tensor:
    """transformers, one input at a time: final-norm hidden state, mean-pooled, L2-normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in inputs:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden.mean(0), dim=0))
    return torch.stack(rows)


def test_batched_equals_transformers_per_input_in_order(runner: ModelRunner, tiny_llama: Path) -> None:
    inputs = _inputs()
    got = torch.tensor(runner.embed(inputs))
    expected = _reference(tiny_llama, inputs)
    cosine = (got * expected).sum(-1)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # Order: each input alone gives its own row.
    for i in (0, 1, 2, len(inputs) - 1):
        torch.testing.assert_close(got[i], torch.tensor(runner.embed([inputs[i]])[0]), atol=1e-5, rtol=1e-5)


def test_embed_leaves_the_kv_cache_as_it_was(runner: ModelRunner) -> None:
    assert runner.kv_cache is not None
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    runner.embed(_inputs())
    assert torch.equal(runner.kv_cache, before)
    runner.kv_cache.zero_()


def test_chunks_take_whole_inputs_up_to_the_budget() -> None:
    chunks = plan_chunks(LENGTHS, BUDGET)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(LENGTHS)))
    flat = [LENGTHS[i] for chunk in chunks for i in chunk]
    assert flat == sorted(LENGTHS)  # shortest first
    for chunk in chunks:
        tokens = sum(LENGTHS[i] for i in chunk)
        assert tokens <= BUDGET or len(chunk) == 1


def test_dense_groups_cover_the_packing_once() -> None:
    lengths = sorted(LENGTHS)
    groups = build_dense_groups(lengths, torch.device("cpu"))
    at = first = 0
    for g in groups:
        assert g.start == at
        members = lengths[first:first + g.num_seqs]
        rows = g.num_seqs * g.length if g.valid_rows is None else len(g.valid_rows)
        assert rows == sum(members) and g.length == max(members)
        at += sum(members)
        first += g.num_seqs
    assert first == len(lengths) and len(groups) > 1
