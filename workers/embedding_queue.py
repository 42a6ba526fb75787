"""EmbeddingQueue: a worker's /v1/embeddings requests, run between engine steps within a step's budget.

An embeddings request is a cache-free forward outside the generation batch (Engine.embed). A line may hold
up to 2048 inputs, each up to the model's context, so a whole line per loop turn could stall every
generating request for minutes. Each turn takes whole inputs, in arrival order and across the queued
requests, up to max_num_batched_tokens tokens (one input at least), and runs them as ONE batched
Engine.embed call (packed forwards: embed_forward.py), then hands back to the engine's next step: a
turn costs about what a generation step of the same budget costs.
The leases the worker holds are kept alive meanwhile by its LeaseKeeper (lease_keeper.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchinfer.store.shards import PendingRequest
from batchinfer.wire.result_row import ResultRow, SuccessRow
from workers.result_rows import embedding_row, error_row

if TYPE_CHECKING:
    from batchinfer.engine.llm_engine import Engine


@dataclass(eq=False)  # removed from the queue by identity, never compared by value
class _Work:
    """A request being run a turn's share at a time: its token ids (on its first turn), its vectors so far."""

    shard_id: int
    request: PendingRequest
    token_ids: list[list[int]] | None = None
    vectors: list[list[float]] = field(default_factory=list)


@dataclass
class _Slice:
    """The inputs start .. end - 1 of a request, taken into this turn."""

    work: _Work
    start: int
    end: int


@dataclass
class EmbeddingDone:
    """A finished embeddings request: its result (or error) row for its shard."""

    shard_id: int
    engine_id: str
    row: ResultRow


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
        """One turn's inputs as one batched call; the requests finished. wanted(shard id, engine id): False
        drops a request whose shard was released or dropped meanwhile."""
        done: list[EmbeddingDone] = []
        slices = self._take(wanted, done)
        if not slices:
            return done
        failed: dict[int, str] = {}
        try:
            self._embed(slices)
        except (ValueError, TypeError):
            # One request's input is bad (too long): run each request's share alone, to fail only that one.
            for part in slices:
                try:
                    self._embed([part])
                except (ValueError, TypeError) as exc:
                    failed[id(part.work)] = str(exc)
        for part in slices:
            work = part.work
            error = failed.get(id(work))
            if error is None and len(work.vectors) < len(work.token_ids or ()):
                continue  # more of it next turn
            self._queue.remove(work)
            done.append(EmbeddingDone(work.shard_id, str(work.request.request_id), self._row(work, error)))
        return done

    def _take(self, wanted: Callable[[int, str], bool], done: list[EmbeddingDone]) -> list[_Slice]:
        """Whole inputs from the front of the queue up to the step budget (one at least); a request that
        cannot be tokenized is finished with its error row into done."""
        budget = self.engine.config.max_num_batched_tokens
        slices: list[_Slice] = []
        tokens = 0
        for work in list(self._queue):
            if not wanted(work.shard_id, str(work.request.request_id)):
                self._queue.remove(work)
                continue
            try:
                ids = self._token_ids(work)
            except (ValueError, TypeError) as exc:
                self._queue.remove(work)
                engine_id = str(work.request.request_id)
                done.append(EmbeddingDone(work.shard_id, engine_id, self._row(work, str(exc))))
                continue
            start = end = len(work.vectors)
            while end < len(ids) and (tokens == 0 or tokens + len(ids[end]) <= budget):
                tokens += len(ids[end])
                end += 1
            if end > start or not ids:
                slices.append(_Slice(work, start, end))
            if end < len(ids):  # the budget is spent
                break
        return slices

    def _token_ids(self, work: _Work) -> list[list[int]]:
        """The request's inputs as token ids (tokenized on its first turn)."""
        if work.token_ids is None:
            token_ids = []
            for i, text in enumerate((work.request.options or {})["input"]):
                try:
                    token_ids.append(self.engine.tokenize(text))
                except ValueError as exc:
                    raise ValueError(f"input[{i}]: {exc}") from None
            work.token_ids = token_ids
        return work.token_ids

    def _embed(self, slices: list[_Slice]) -> None:
        """One Engine.embed over the slices' inputs; each request's vectors extended by its share."""
        inputs: list[str | list[int]] = []
        for part in slices:
            inputs += (part.work.token_ids or [])[part.start : part.end]
        vectors, _ = self.engine.embed(inputs, first_index=slices[0].start if len(slices) == 1 else 0)
        at = 0
        for part in slices:
            count = part.end - part.start
            part.work.vectors += vectors[at : at + count]
            at += count

    def _row(self, work: _Work, error: str | None) -> ResultRow:
        """The request's result row, or its error row."""
        if error is not None:
            return error_row(work.request, "invalid_request", error)
        encoding = (work.request.options or {}).get("encoding_format", "float")
        tokens = sum(map(len, work.token_ids or ()))
        row: SuccessRow = embedding_row(work.request, work.vectors, tokens, encoding)
        row["model"] = self.model
        return row
