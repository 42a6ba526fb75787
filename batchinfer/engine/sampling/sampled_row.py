"""SampledRow: what the sampler's processing reads of one row of logits.

A row is an engine Sequence, or (speculative verification, spec_decode/verify.py) a PositionView: the
sequence as it would be after it had also produced some draft tokens. Both have these members.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchinfer.engine.sampling_params import SamplingParams


class SampledRow(Protocol):
    """The row's params, its tokens so far and its tokenized bad words (read only)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def bad_words_token_ids(self) -> list[list[int]]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
