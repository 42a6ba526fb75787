"""EmbeddingQueue: a line's inputs run a step's token budget per loop turn (one input at least), in order,
and add up to exactly what one Engine.embed over the whole line gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM
from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.store.shards import PendingRequest
from workers.embedding_queue import EmbeddingQueue

INPUTS = ["the cat reads a long book about the dog", "a bird", "the dog reads it again, twice, slowly",
          [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def _request(request_id: int, inputs: list) -> PendingRequest:
    return PendingRequest(request_id=request_id, custom_id=f"e{request_id}", line_number=request_id,
                          endpoint="embeddings", messages=None, prompt=None, params=SamplingParams(),
                          options={"input": inputs})


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    with LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_batched_tokens=16, max_num_seqs=2,
             max_model_len=64) as llm:
        yield llm.engine


def test_a_line_runs_a_step_budget_per_turn(engine) -> None:
    queue = EmbeddingQueue(engine, "m")
    queue.add(1, _request(1, INPUTS))
    queue.add(1, _request(2, ["short"]))
    lengths = [len(engine.tokenize(text)) for text in INPUTS]
    assert sum(lengths) > 2 * 16  # the line spans several turns
    turns = []
    while not turns or not turns[-1]:
        turns.append(queue.run(lambda shard_id, engine_id: True))
        assert len(turns) <= len(INPUTS)
    assert len(turns) > 1
    done = turns[-1]
    assert [d.engine_id for d in done][0] == "1"
    expected, tokens = engine.embed(INPUTS)
    row = done[0].row
    assert row["prompt_tokens"] == tokens == sum(lengths)
    torch.testing.assert_close(torch.tensor(row["embeddings"]), torch.tensor(expected))


def test_an_input_too_long_errors_the_line_naming_its_index(engine) -> None:
    queue = EmbeddingQueue(engine, "m")
    queue.add(1, _request(1, ["fine", [5] * 10_000]))
    done = []
    while not done:
        done = queue.run(lambda shard_id, engine_id: True)
    message = done[0].row["error"]["message"]
    assert message.startswith("line 1: input[1]: 10000 tokens exceed the model's context")


def test_a_dropped_shard_drops_its_requests(engine) -> None:
    queue = EmbeddingQueue(engine, "m")
    queue.add(7, _request(1, INPUTS))
    assert queue.run(lambda shard_id, engine_id: shard_id != 7) == []
    assert queue.run(lambda shard_id, engine_id: True) == []  # nothing left of it
