"""EmbeddingQueue (issue 34): a turn takes whole inputs across the queued requests up to the step budget (one
input at least) and runs them as ONE Engine.embed call; a bad input fails only its own request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.store.shards import PendingRequest
from workers.embedding_queue import EmbeddingQueue

BUDGET = 10


@dataclass
class _Config:
    max_num_batched_tokens: int = BUDGET


@dataclass
class _FakeEngine:
    """Tokens: one per word; an embedding: [tokens]; a word 'bad' is an input the engine refuses."""

    config: _Config = field(default_factory=_Config)
    calls: list[list[int]] = field(default_factory=list)

    def tokenize(self, text: str) -> list[int]:
        return [99 if word == "bad" else 1 for word in text.split()]

    def embed(self, inputs: list[list[int]], *, first_index: int = 0) -> tuple[list[list[float]], int]:
        self.calls.append([len(ids) for ids in inputs])
        for i, ids in enumerate(inputs, start=first_index):
            if 99 in ids:
                raise ValueError(f"input[{i}]: refused")
        return [[float(len(ids))] for ids in inputs], sum(map(len, inputs))


def _request(request_id: int, inputs: list[str]) -> PendingRequest:
    return PendingRequest(request_id=request_id, custom_id=f"e{request_id}", line_number=request_id,
                          endpoint="embeddings", messages=None, prompt=None, params=SamplingParams(),
                          options={"input": inputs})


def _words(n: int) -> str:
    return " ".join(["w"] * n)


def _queue(engine: _FakeEngine) -> EmbeddingQueue:
    return EmbeddingQueue(engine, "m")  # type: ignore[arg-type]  # the fake has what the queue reads


def test_a_turn_takes_whole_inputs_up_to_the_budget_in_one_call() -> None:
    engine = _FakeEngine()
    queue = _queue(engine)
    queue.add(1, _request(1, [_words(3), _words(4)]))
    queue.add(1, _request(2, [_words(2), _words(5), _words(1)]))
    queue.add(2, _request(3, [_words(25)]))  # longer than the budget: a turn of its own
    turns: list[Any] = []
    while len(turns) < 10 and (not turns or queue._queue):
        turns.append(queue.run(lambda shard_id, engine_id: True))
    assert engine.calls == [[3, 4, 2], [5, 1], [25]]  # each turn one call, whole inputs, <= budget
    finished = [d.engine_id for turn in turns for d in turn]
    assert finished == ["1", "2", "3"]
    rows = {d.engine_id: d.row for turn in turns for d in turn}
    assert rows["2"]["prompt_tokens"] == 8 and rows["1"]["prompt_tokens"] == 7


def test_a_bad_input_fails_only_its_request() -> None:
    engine = _FakeEngine()
    queue = _queue(engine)
    queue.add(1, _request(1, [_words(2)]))
    queue.add(1, _request(2, ["w bad"]))
    queue.add(1, _request(3, [_words(3)]))
    done = queue.run(lambda shard_id, engine_id: True)
    by_id = {d.engine_id: d.row for d in done}
    assert set(by_id) == {"1", "2", "3"}
    assert by_id["2"]["error"]["message"] == "line 2: input[0]: refused"
    assert "error" not in by_id["1"] and "error" not in by_id["3"]
