"""StructuredRequests: the engine loop's side of structured output (the grammars themselves: structured.py).

A constrained request's grammar compiles in the background, on the grammar backend's pool (made by the
first constrained request: it imports xgrammar and reads the whole vocabulary). Until it is compiled the
request waits here, outside the scheduler, so nothing else waits for it; each step the engine queues the
compiled ones and ends those whose compile failed. Each step fills the grammar bitmask of the constrained
rows (the sampler masks those rows only), and each accepted token advances the row's matcher.
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from batchinfer.engine.sampling.sampler import GrammarMask
from batchinfer.engine.sampling.structured import GrammarBackend
from batchinfer.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase
    from xgrammar import CompiledGrammar

    from batchinfer.engine.sampling.grammar_state import GrammarState

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # with nothing else to run, how long one step waits for a grammar to compile


class StructuredRequests:
    """The grammar backend (made on first use) and the constrained requests still compiling, in order."""

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int,
                 eos_token_ids: AbstractSet[int], device: str | torch.device) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.backend: GrammarBackend | None = None
        self.awaiting: list[SequenceGroup] = []

    def grammars(self) -> GrammarBackend:
        """The grammar backend, made on first use."""
        if self.backend is None:
            self.backend = GrammarBackend(
                self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
                max_num_seqs=self.config.max_num_seqs, device=self.device,
                compile_workers=self.config.grammar_compile_workers,
                compile_timeout_s=self.config.grammar_compile_timeout_s,
                cache_bytes=self.config.compiled_grammar_cache_bytes,
            )
        return self.backend

    def compile(self, constraint: StructuredOutputsParams, *, owner: str | None) -> Future[CompiledGrammar]:
        """The compiled grammar's future, queued in `owner`'s turn; ValueError if it is known to fail."""
        compiled = self.grammars().compile(constraint, owner=owner)
        if compiled.done() and compiled.exception() is not None:
            raise ValueError(f"structured_outputs: {compiled.exception()}")
        return compiled

    def start(self, group: SequenceGroup) -> None:
        """Give a request's constrained sequences their matchers (their grammar is compiled by now)."""
        for seq in group.seqs:
            if seq.grammar is not None:
                self.grammars().start(seq.grammar)

    def hold(self, group: SequenceGroup) -> None:
        """Keep a request out of the scheduler until its grammar is compiled."""
        self.awaiting.append(group)

    def drop(self, group: SequenceGroup) -> bool:
        """Forget a held request (aborted); False if it is not held here."""
        if not any(held is group for held in self.awaiting):
            return False
        self.awaiting = [held for held in self.awaiting if held is not group]
        return True

    def take_compiled(self) -> tuple[list[SequenceGroup], list[tuple[SequenceGroup, str]]]:
        """(the held requests whose grammar is compiled, in order; (request, error) of those whose compile
        failed); the rest stay held."""
        waiting, ready, failed = [], [], []
        for group in self.awaiting:
            compiled = _grammar(group).compiled
            if not compiled.done():
                waiting.append(group)
            elif compiled.exception() is None:
                ready.append(group)
            else:  # past grammar_compile_timeout_seconds, or (checked at ingest) unexpected
                logger.warning("request %s: its grammar failed to compile: %s", group.request_id,
                               compiled.exception())
                failed.append((group, f"structured_outputs: {compiled.exception()}"))
        self.awaiting = waiting
        return ready, failed

    def wait_for_one(self) -> None:
        """Nothing to run but compiles: wait (briefly) for one rather than spin."""
        wait([_grammar(group).compiled for group in self.awaiting], GRAMMAR_WAIT_S,
             return_when=FIRST_COMPLETED)

    def mask(self, seqs: list[Sequence]) -> GrammarMask | None:
        """The bitmask of this step's constrained rows (None when every row is free)."""
        if self.backend is None:
            return None
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        bitmask = self.backend.fill_bitmask(seqs, rows)
        return GrammarMask(bitmask[: len(seqs)], rows)

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """Advance a constrained sequence's matcher by its sampled token; True if that ends the sequence."""
        assert self.backend is not None and seq.grammar is not None
        if not self.backend.accept(seq.grammar, token_id):
            # The mask allows only what the matcher accepts, so this is a bug, not bad input.
            logger.error("request %s: its grammar rejected sampled token %d", seq.request_id, token_id)
            seq.status = SequenceStatus.FINISHED_ABORTED
            return True
        assert seq.grammar.matcher is not None  # started when the request was queued
        if seq.grammar.matcher.is_terminated():  # a stop token of the grammar that is not an EOS id
            seq.status = SequenceStatus.FINISHED_STOPPED
            return True
        return False

    def close(self) -> None:
        """Stop the compile threads (a running compile is waited for: structured.py)."""
        if self.backend is not None:
            self.backend.close()


def _grammar(group: SequenceGroup) -> GrammarState:
    """A held request's grammar state (only constrained requests are held)."""
    state = group.seqs[0].grammar
    assert state is not None
    return state
