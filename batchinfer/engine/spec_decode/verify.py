"""Verify a step's speculating rows: the sampler's processing per position, then the acceptance rules.

Sequence i proposing d_1..d_k brings k + 1 rows of target logits: those of its last real token and of
d_1..d_k. Row j is processed by the sampler exactly as it would be without speculation after the
sequence had already produced d_1..d_j (a `PositionView`): min_tokens counts them, penalties and
bad_words see them. Then rejection.py decides, per sequence, which tokens are emitted; their logprobs
come from the raw log-softmax of their own row.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.sampling.sampler import SampleLogprobs, Sampler, argmax_rows, gather_logprobs
from batchinfer.engine.spec_decode.rejection import accept_greedy, accept_replay, rejection_sample

if TYPE_CHECKING:
    from batchinfer.engine.core.sequence import Sequence
    from batchinfer.engine.sampling_params import SamplingParams


@dataclass
class Proposal:
    """One sequence's guess for this step: k draft tokens and, from a sampling draft model, q [k, vocab]."""

    seq: Sequence
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None


class PositionView:
    """A sequence as the sampler sees it after it has also produced `drafts` (read-only but for generator)."""

    __slots__ = ("_seq", "_drafts")

    def __init__(self, seq: Sequence, drafts: list[int]) -> None:
        self._seq, self._drafts = seq, drafts

    @property
    def params(self) -> SamplingParams:
        return self._seq.params

    @property
    def seed(self) -> int | None:
        return self._seq.seed

    @property
    def generator(self) -> torch.Generator | None:
        return self._seq.generator

    @generator.setter
    def generator(self, value: torch.Generator | None) -> None:
        self._seq.generator = value

    @property
    def grammar(self) -> None:
        return None  # constrained sequences do not speculate

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._seq.bad_words_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self._seq.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._seq.num_output_tokens + len(self._drafts)

    @property
    def num_tokens(self) -> int:
        return self._seq.num_tokens + len(self._drafts)

    @property
    def token_ids(self) -> list[int]:
        return self._seq.token_ids + self._drafts

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._seq.output_token_ids + self._drafts


def _generator_of(seq: Sequence, seed: int, device: torch.device) -> torch.Generator:
    """The sequence's own generator, made as the sampler makes it (seeded with seq.seed) on first use."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        seq.generator.manual_seed(seed)
    return seq.generator


def verify(sampler: Sampler, logits: torch.Tensor, proposals: list[Proposal],
           eos_token_ids: AbstractSet[int]) -> list[list[tuple[int, SampleLogprobs | None]]]:
    """Per proposal, the emitted (token id, logprobs) in order: 1 .. k + 1 of them.

    `logits` holds the k_i + 1 rows of every proposal, concatenated in order.
    """
    views = [PositionView(p.seq, p.draft_token_ids[:j]) for p in proposals
             for j in range(len(p.draft_token_ids) + 1)]
    assert logits.shape[0] == len(views), f"{logits.shape[0]} logits rows for {len(views)} positions"
    processed = sampler.process(logits, views, eos_token_ids)
    rows_logits = processed.logits
    greedy = [p.seq.params.is_greedy for p in proposals]
    argmax = argmax_rows(rows_logits).tolist() if any(greedy) else []
    probs = None
    if processed.random_rows:
        probs = torch.empty_like(rows_logits)
        probs[processed.random_rows] = sampler.random_probs(
            rows_logits[processed.random_rows], [views[i].params for i in processed.random_rows])
    raw_index = {row: i for i, row in enumerate(processed.want_logprobs)}
    out: list[list[tuple[int, SampleLogprobs | None]]] = []
    offset = 0
    for proposal, is_greedy in zip(proposals, greedy, strict=True):
        seq, drafts = proposal.seq, proposal.draft_token_ids
        width = len(drafts) + 1
        if is_greedy:
            emitted = accept_greedy(argmax[offset : offset + width], drafts)
        else:
            assert probs is not None
            rows = probs[offset : offset + width]
            if seq.seed is not None:
                emitted = accept_replay(rows, drafts, _generator_of(seq, seq.seed, rows.device))
            else:
                emitted = rejection_sample(rows, drafts, proposal.draft_probs, sampler.generator)
        figures: list[SampleLogprobs | None] = [None] * len(emitted)
        if seq.params.logprobs is not None and processed.raw_logprobs is not None:
            raw_rows = [raw_index[offset + j] for j in range(len(emitted))]
            figures = list(gather_logprobs(
                processed.raw_logprobs[raw_rows], torch.tensor(emitted, device=rows_logits.device),
                [seq.params.logprobs] * len(emitted)))
        out.append(list(zip(emitted, figures, strict=True)))
        offset += width
    return out
