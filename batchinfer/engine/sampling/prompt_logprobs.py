"""Prompt logprobs (vLLM's `prompt_logprobs`): per prompt token, its logprob, rank and the top N tokens under
the raw (unprocessed) logits of the position before it.

Position p's logits predict token p + 1, so a chunk computing positions [start, end) yields the entries of
tokens start + 1 .. end, capped at the prompt; the first token's entry is None (nothing predicts it). The
request's first sequence collects them in order. The scheduler gives such a sequence no prefix-cache hit and
bounded chunks (scheduler.PROMPT_LOGPROBS_CHUNK); a sequence preempted midway recomputes from position 0 and
skips the entries it already has.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.core.sequence import Sequence
from batchinfer.engine.outputs import make_logprob_entry
from batchinfer.engine.sampling.sampler import gather_logprobs

if TYPE_CHECKING:
    from batchinfer.engine.core.tokenizer import TextTokenizer


def logits_counts(scheduled: Seq[tuple[Sequence, int]]) -> list[int]:
    """Logits asked per entry of a step: every scheduled token of a sequence collecting prompt logprobs."""
    return [num_new if seq.needs_prompt_logprobs else 1 for seq, num_new in scheduled]


def collect(seq: Sequence, start: int, logits: torch.Tensor, tokenizer: TextTokenizer) -> None:
    """Append the prompt entries that positions start .. start + len(logits) - 1 (the rows) yield."""
    entries = seq.prompt_logprobs
    assert entries is not None
    first = max(start, len(entries) - 1)  # entries[k] comes from position k - 1
    stop = min(start + len(logits), seq.num_prompt_tokens - 1)
    if first >= stop:
        return
    raw = torch.log_softmax(logits[first - start : stop - start].float(), dim=-1)
    targets = seq.token_ids[first + 1 : stop + 1]
    figures = gather_logprobs(raw, torch.tensor(targets, device=raw.device),
                              [seq.params.prompt_logprobs] * len(targets))
    for token, fig in zip(targets, figures, strict=True):
        entries.append(make_logprob_entry(tokenizer, token, fig))
