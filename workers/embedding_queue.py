"""EmbeddingQueue: a worker's /v1/embeddings requests, run between engine steps within a step's budget.

An embeddings request is a plain forward per input outside the generation batch (Engine.embed). A line may
hold up to 2048 inputs, each up to the model's context, so a whole line per loop turn could stall every
generating request for minutes. Each turn runs inputs, in order, until max_num_batched_tokens tokens are
read (one input at least, since an input is one forward), then hands back to the engine's next step.
The leases the worker holds are kept alive meanwhile by its LeaseKeeper (lease_keeper.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchinfer.store.shards import PendingRequest
from workers.result_rows import embedding_row, error_row

if TYPE_CHECKING:
    from batchinfer.engine.llm_engine import Engine


@dataclass
class _Work:
    """A request being run input by input: its token ids (on its first turn) and the vectors so far."""

    shard_id: int
    request: PendingRequest
    token_ids: list[list[int]] | None = None
    vectors: list[list[float]] = field(default_factory=list)


@dataclass
class EmbeddingDone:
    """A finished embeddings request: its result (or error) row for its shard."""

    shard_id: int
    engine_id: str
    row: dict[str, Any]


class EmbeddingQueue:
    """The embeddings requests of the shards a worker holds, in arrival order."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model
        self._queue: deque[_Work] = deque()

    def add(self, shard_id: int, request: PendingRequest) -> None:
        """Queue a request (its line was checked at ingest)."""
        self._queue.append(_Work(shard_id, request))

    def run(self, wanted: Callable[[int, str], bool]) -> list[EmbeddingDone]:
        """One turn's inputs; the requests finished. wanted(shard id, engine id): False drops a request whose
        shard was released or dropped meanwhile."""
        done = []
        budget = self.engine.config.max_num_batched_tokens
        while self._queue and budget > 0:
            work = self._queue[0]
            engine_id = str(work.request.request_id)
            if not wanted(work.shard_id, engine_id):
                self._queue.popleft()
                continue
            try:
                budget -= self._embed_next(work)
                if len(work.vectors) < len(work.token_ids or ()):
                    continue
                encoding = (work.request.options or {}).get("encoding_format", "float")
                tokens = sum(map(len, work.token_ids or ()))
                row = {**embedding_row(work.request, work.vectors, tokens, encoding), "model": self.model}
            except (ValueError, TypeError) as exc:
                row = error_row(work.request, "invalid_request", str(exc))
            self._queue.popleft()
            done.append(EmbeddingDone(work.shard_id, engine_id, row))
        return done

    def _embed_next(self, work: _Work) -> int:
        """Pool the request's next input (tokenizing them all on its first turn); the tokens it read."""
        if work.token_ids is None:
            work.token_ids = []
            for i, text in enumerate((work.request.options or {})["input"]):
                try:
                    work.token_ids.append(self.engine.tokenize(text))
                except ValueError as exc:
                    raise ValueError(f"input[{i}]: {exc}") from None
        index = len(work.vectors)
        vectors, tokens = self.engine.embed([work.token_ids[index]], first_index=index)
        work.vectors += vectors
        return tokens
