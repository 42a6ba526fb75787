"""What the engine hands back: RequestOutput / CompletionOutput / Logprob, EmbeddingRequestOutput
(vLLM's shapes), and the code that builds them from a request's sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from batchinfer.engine.logprob import Logprob as Logprob  # re-exported: the public name lives here too

if TYPE_CHECKING:  # for annotations only: this module stays free of torch
    from batchinfer.engine.core.sequence import SequenceGroup
    from batchinfer.engine.core.tokenizer import TextTokenizer
    from batchinfer.engine.sampling.sampler import SampleLogprobs

@dataclass
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled + top-N
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched


@dataclass
class EmbeddingOutput:
    """One input's pooled embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's answer for one input (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions (final once `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # vLLM's prompt_logprobs: per prompt token (the first is None) its logprob and the top N, if asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why a request ended without running (its grammar failed or timed out)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt in tokens."""
        return len(self.prompt_token_ids)


def make_logprob_entry(tokenizer: TextTokenizer, token_id: int,
                       figures: SampleLogprobs) -> dict[int, Logprob]:
    """One position's logprobs: the sampled token first, then the top-N (ranks 1..N), texts decoded."""
    ids = [token_id, *figures.top_token_ids]
    texts = tokenizer.batch_decode([[i] for i in ids])
    entry = {token_id: Logprob(figures.logprob, figures.rank, texts[0])}
    for rank, (tid, lp, text) in enumerate(
        zip(figures.top_token_ids, figures.top_logprobs, texts[1:], strict=True), start=1
    ):
        entry.setdefault(tid, Logprob(lp, rank, text))
    return entry


def make_request_output(group: SequenceGroup) -> RequestOutput:
    """A request's output as of now: its completions' text so far and its milestone times."""
    seqs = group.seqs
    outputs = []
    for seq in seqs:
        finished = seq.is_finished
        assert seq.detokenizer is not None  # set by the engine when the request is added
        outputs.append(
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.text(finished=finished),
                token_ids=seq.output_token_ids,
                finish_reason=seq.status.finish_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob,
                stop_reason=seq.stop_reason,
            )
        )
    finished_times = [s.finished_time for s in seqs]
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=list(group.prompt_token_ids),
        outputs=outputs,
        finished=all(s.is_finished for s in seqs),
        num_cached_tokens=seqs[0].num_cached_tokens or 0,
        prompt_logprobs=None if seqs[0].prompt_logprobs is None else list(seqs[0].prompt_logprobs),
        metrics=RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=min(
                (s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None), default=None
            ),
            first_token_time=min(
                (s.first_token_time for s in seqs if s.first_token_time is not None), default=None
            ),
            finished_time=None if None in finished_times else max(cast("list[float]", finished_times)),
        ),
    )
