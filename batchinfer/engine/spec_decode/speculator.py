"""The engine's side of speculative decoding: propose for the rows the scheduler gave lookahead slots, run
the drafts through the target as part of the step, verify, and count.

The drafts are appended to seq.token_ids only while the target runs (`drafts_in_token_ids`), so the model
runner and the tensor-parallel step channel see an ordinary chunk, token_ids[c : c + 1 + k] at positions
c .. c + k (ARCHITECTURE.md, contract 3), and everything else (stop rules, block hashes, outputs) only
ever sees accepted tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from batchinfer.engine.spec_decode import make_proposer
from batchinfer.engine.spec_decode.verify import Proposal, verify
from batchinfer.engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.core.sequence import Sequence as EngineSequence
    from batchinfer.engine.sampling.sampler import SampleLogprobs, Sampler


# The engine's per-token path: (sequence, token id, its logprobs or None, time.time()) -> None
AppendToken = Callable[["EngineSequence", int, "SampleLogprobs | None", float], None]


class SpecStats(TypedDict):
    """The spec_* fields of EngineStats (metrics.py), as SpecDecodeCounts.as_stats gives them."""

    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_position: list[int]


@dataclass
class SpeculativeStep:
    """One step's proposals, by row of the scheduled list (only rows that got at least one draft)."""

    proposals: dict[int, Proposal] = field(default_factory=dict)

    def grown(self, scheduled: Sequence[tuple[EngineSequence, int]]) -> list[tuple[EngineSequence, int]]:
        """The step as the target runs it: each speculating entry computes its drafts too."""
        out = list(scheduled)
        for row, proposal in self.proposals.items():
            seq, num_new = out[row]
            out[row] = (seq, num_new + len(proposal.draft_token_ids))
        return out

    def logits_counts(self, counts: list[int] | None, num_entries: int) -> list[int]:
        """Logits rows per entry: k + 1 for a speculating entry (its last token and each draft)."""
        out = list(counts) if counts is not None else [1] * num_entries
        for row, proposal in self.proposals.items():
            out[row] = len(proposal.draft_token_ids) + 1
        return out

    @contextlib.contextmanager
    def drafts_in_token_ids(self) -> Iterator[None]:
        """Append each speculating sequence's drafts to its token_ids for the duration of the forward."""
        for proposal in self.proposals.values():
            proposal.seq.token_ids.extend(proposal.draft_token_ids)
        try:
            yield
        finally:
            for proposal in self.proposals.values():
                del proposal.seq.token_ids[-len(proposal.draft_token_ids):]


@dataclass
class SpecDecodeCounts:
    """vLLM's spec-decode counters: proposals, proposed tokens, accepted tokens, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """Count one sequence's verification: num_drafts proposed, the first num_accepted accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def copy(self) -> SpecDecodeCounts:
        """A snapshot."""
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                list(self.accepted_per_position))

    def since(self, earlier: SpecDecodeCounts | None) -> SpecDecodeCounts:
        """What was counted after the snapshot `earlier` (None: since the start)."""
        if earlier is None:
            return self.copy()
        before = earlier.accepted_per_position
        return SpecDecodeCounts(
            self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [n - (before[i] if i < len(before) else 0) for i, n in enumerate(self.accepted_per_position)],
        )

    def as_stats(self) -> SpecStats:
        """The EngineStats fields (spec_*) of these counts."""
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position)}


class Speculator:
    """Owns the proposer and the spec-decode counters of one engine."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, *, num_kv_blocks: int, vocab_size: int,
                 max_model_len: int) -> None:
        self.spec = spec
        self.proposer = make_proposer(spec, config, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size,
                                      max_model_len=max_model_len)
        self.counts = SpecDecodeCounts()

    def close(self) -> None:
        """Release the proposer (the draft model's runner)."""
        self.proposer.close()

    def forget(self, seqs: Sequence[EngineSequence]) -> None:
        """Preempted sequences lost their blocks: the draft's cache of them is gone too."""
        self.proposer.forget(seqs)

    def propose(self, scheduled: Sequence[tuple[EngineSequence, int]],
                lookahead: Sequence[tuple[int, int]]) -> SpeculativeStep | None:
        """Proposals for the scheduler's lookahead rows; None when no row got a draft."""
        seqs = [scheduled[row][0] for row, _ in lookahead]
        results = self.proposer.propose(seqs, [limit for _, limit in lookahead])
        step = SpeculativeStep()
        for (row, _), seq, (drafts, draft_probs) in zip(lookahead, seqs, results, strict=True):
            if drafts:
                step.proposals[row] = Proposal(seq, drafts, draft_probs)
        return step if step.proposals else None

    def verify_and_append(self, step: SpeculativeStep, logits: torch.Tensor, ends: list[int],
                          sampler: Sampler, eos_token_ids: AbstractSet[int],
                          append_token: AppendToken) -> tuple[int, list[EngineSequence]]:
        """Verify the speculating rows and append what they emit: (tokens appended, their sequences).

        Tokens go one by one through the engine's append_token (stop rules, logprobs, max_tokens), stopping
        at the first that finishes the sequence; num_computed_tokens then covers the accepted drafts
        appended (their K/V was computed this step), never the last token. Rejected drafts' K/V is simply
        overwritten later. `ends[row]`: where the row's logits end (k + 1 rows each).
        """
        proposals = list(step.proposals.items())
        rows = [i for row, p in proposals for i in range(ends[row] - len(p.draft_token_ids) - 1, ends[row])]
        emitted = verify(sampler, logits[rows], [p for _, p in proposals], eos_token_ids)
        now = time.time()
        appended = 0
        for (_, proposal), tokens in zip(proposals, emitted, strict=True):
            seq = proposal.seq
            self.counts.add(len(proposal.draft_token_ids), len(tokens) - 1)
            for i, (token_id, figures) in enumerate(tokens):
                append_token(seq, token_id, figures, now)
                appended += 1
                if seq.is_finished:
                    break
                if i < len(tokens) - 1:  # an accepted draft: its K/V was computed this step
                    seq.num_computed_tokens += 1
        return appended, [p.seq for _, p in proposals]
