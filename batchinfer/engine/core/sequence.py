"""Sequence: the state of one completion (one of a request's n) as it moves through the engine;
SequenceGroup: a request's n sequences, which share its prompt.

The model runner reads three fields of a sequence and nothing else (ARCHITECTURE.md, contract 2):
`token_ids` (prompt + generated so far), `num_computed_tokens` (tokens whose K/V is in the cache) and
`block_table` (physical block ids; block i holds positions [i * block_size, (i + 1) * block_size)),
plus `lora_request` (the adapter its tokens run under, None for the base model) when LoRA is enabled.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from batchinfer.engine.core.detokenizer import IncrementalDetokenizer
    from batchinfer.engine.logprob import Logprob
    from batchinfer.engine.lora.request import LoRARequest
    from batchinfer.engine.sampling.grammar_state import GrammarState


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence.

    WAITING -> RUNNING -> FINISHED_*          the normal path
    RUNNING -> PREEMPTED -> RUNNING            out of KV blocks: blocks freed, recomputed when readmitted
    WAITING | RUNNING | PREEMPTED -> FINISHED_ABORTED    abort()

    WAITING     queued, never admitted; holds no blocks.
    RUNNING     admitted; holds blocks for every computed token; scheduled each step while budget allows.
    PREEMPTED   evicted from RUNNING under block pressure; holds no blocks, num_computed_tokens == 0;
                waits at the front of the queue and recomputes prompt + generated tokens when readmitted.
    FINISHED_STOPPED        EOS, a stop token id or a stop string (finish_reason "stop").
    FINISHED_LENGTH_CAPPED  max_tokens or max_model_len reached (finish_reason "length").
    FINISHED_ABORTED        abort() (finish_reason "abort").
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """True for the three FINISHED_* states."""
        # By value: a str lookup is C-level, while hashing an Enum member runs Enum.__hash__ in Python, and
        # this is asked several times per sequence per step.
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason of a finished status ("stop", "length", "abort"), else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

_FINISHED_VALUES = frozenset(status.value for status in _FINISH_REASONS)

_seq_ids = itertools.count()


class Sequence:
    """One completion of one request: its tokens, KV bookkeeping, sampling state and timings."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        index: int = 0,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens, or the room left in the context
        self.seed = params.seed_for_child(index)
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # lora.LoRARequest or None (the base model); part of the block hash
        self.status = SequenceStatus.WAITING

        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.block_table: list[int] = []
        # Chained hashes of the full blocks of token_ids, filled lazily by the block manager. A function of
        # the tokens, the cache salt and the adapter only, so it survives preemption.
        self.block_hashes: list[bytes] = []

        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # Per prompt token, its logprobs (the first token has none: nothing predicts it). Collected by the
        # request's first sequence only, chunk by chunk; complete once it holds num_prompt_tokens entries.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None
        )
        self.generator: torch.Generator | None = None  # for seeded sampling, created by the sampler
        self.detokenizer: IncrementalDetokenizer | None = None  # set by the engine
        self.grammar: GrammarState | None = None  # a constrained request's, set by the engine
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words tokenized, set by the engine

        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # for inter-token latency
        self.finished_time: float | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"status={self.status.name}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """True once the sequence reached a FINISHED_* status."""
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt token's logprobs are still to be computed (no prefix-cache hit then)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens


@dataclass
class SequenceGroup:
    """One request as the engine tracks it: its prompt and its n sequences (vLLM's SequenceGroup)."""

    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float

    @property
    def is_finished(self) -> bool:
        """True once every sequence has finished."""
        return all(seq.is_finished for seq in self.seqs)
