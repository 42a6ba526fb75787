"""GrammarBackend: structured output in the engine, on xgrammar (vLLM's default grammar backend).

- Compile: each distinct constraint (StructuredOutputsParams.cache_key, a hash) is compiled against the
  tokenizer once, in a background thread, so a new schema never stalls the step; compiled grammars stay
  in an LRU cache. A request whose grammar is still compiling waits outside the scheduler (llm_engine.py).
- GrammarState: one per constrained sequence (each of n siblings has its own): its matcher, and how many
  of the sequence's output tokens the matcher has accepted.
- Bitmask: one [max_num_seqs, ceil(vocab / 32)] int32 buffer; each step the constrained rows are filled in
  one batched call and the sampler masks those rows only (sampler.py), unconstrained rows untouched. The
  engine fills it after the forward pass is launched and before the sampler reads the logits, so on a GPU
  the fill (CPU work) overlaps the forward pass.

The mask is as wide as the model's logits (the model's vocab_size, which may exceed the tokenizer's: a
padded vocabulary; ids the tokenizer lacks are never allowed). The grammar's stop tokens are the engine's
EOS ids: after the grammar's end only they are allowed, and sampling one finishes the sequence ("stop").

Preemption recomputes: a preempted sequence keeps its tokens, so its matcher stays valid. `sync` still
rolls the matcher back, or replays tokens into it, whenever the accepted count and the output disagree.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from cachetools import LRUCache

from batchinfer.engine.grammars import build_grammar
from batchinfer.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from batchinfer.engine.sequence import Sequence

logger = logging.getLogger(__name__)

COMPILE_WORKERS = 1  # one background compile at a time: it must not compete with the step for cores
# xgrammar's threads within one compilation, and filling the batch's bitmask rows (~20-90 us a row at
# vocab 49k, one thread): half the cores, 2 to 8.
XGRAMMAR_THREADS = min(8, max(2, (os.cpu_count() or 2) // 2))
# Below this many constrained rows the bitmask is filled on the calling thread: waking fill threads costs
# more than it saves (measured ~4 ms a step for 4 rows on a loaded 2-core machine, 0.1 ms inline).
PARALLEL_FILL_ROWS = 64
COMPILED_CACHE_SIZE = 256  # distinct compiled grammars kept (a batch job has a handful)


class GrammarState:
    """The grammar side of one constrained sequence: its compiled grammar (a future) and matcher."""

    __slots__ = ("compiled", "matcher", "num_accepted")

    def __init__(self, compiled: Future[Any]) -> None:
        self.compiled = compiled
        self.matcher: Any = None  # xgrammar GrammarMatcher, made when the compile is done
        self.num_accepted = 0  # output tokens the matcher has accepted

    @property
    def ready(self) -> bool:
        """True once the grammar finished compiling (successfully or not)."""
        return self.compiled.done()


class GrammarBackend:
    """Compiles constraints for one tokenizer and keeps the step's token bitmask."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: AbstractSet[int],
        max_num_seqs: int,
        device: str | torch.device = "cpu",
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size  # the model's logits width
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        # Our LRU of futures is the cache: xgrammar's own would keep a second copy of each grammar.
        self.compiler = xgr.GrammarCompiler(info, max_threads=XGRAMMAR_THREADS, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="batchinfer-grammar")
        self._compiled: LRUCache[str, Future[Any]] = LRUCache(maxsize=COMPILED_CACHE_SIZE)
        self.bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        if torch.device(device).type == "cuda":
            self.bitmask = self.bitmask.pin_memory()  # copied to the GPU every step, asynchronously
        self._fill_inline = xgr.BatchGrammarMatcher(max_threads=1)
        self._fill_parallel = xgr.BatchGrammarMatcher(max_threads=XGRAMMAR_THREADS)
        self.num_compiled = 0
        self.compile_seconds = 0.0  # summed over compilations, in the background thread

    def close(self) -> None:
        """Stop the compile thread (pending compilations are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def compile(self, constraint: StructuredOutputsParams) -> Future[Any]:
        """The compiled grammar of `constraint`, as a future: started now unless already cached."""
        key = constraint.cache_key
        future = self._compiled.get(key)
        if future is None:
            future = self._pool.submit(self._compile, constraint)
            self._compiled[key] = future
        return future

    def _compile(self, constraint: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        grammar = build_grammar(constraint.kind, constraint.value,
                                any_whitespace=not constraint.disable_any_whitespace)
        compiled = self.compiler.compile_grammar(grammar)
        self.compile_seconds += time.perf_counter() - start
        self.num_compiled += 1
        return compiled

    def start(self, state: GrammarState) -> None:
        """Give a compiled state its matcher (raises the compile's error if it failed)."""
        state.matcher = self._xgr.GrammarMatcher(state.compiled.result())
        state.num_accepted = 0

    def fill_bitmask(self, seqs: Seq[Sequence], rows: list[int]) -> torch.Tensor:
        """Fill bitmask row i with the tokens seqs[i]'s grammar allows next, for each i in rows.

        Returns the whole buffer: rows not listed hold stale bits (the sampler reads the listed rows only).
        """
        states = []
        for row in rows:
            seq = seqs[row]
            state = seq.grammar
            if state.num_accepted != seq.num_output_tokens:
                sync(state, seq.output_token_ids)
            states.append(state.matcher)
        filler = self._fill_parallel if len(rows) >= PARALLEL_FILL_ROWS else self._fill_inline
        filler.batch_fill_next_token_bitmask(states, self.bitmask, rows)
        return self.bitmask

    def accept(self, state: GrammarState, token_id: int) -> bool:
        """Advance the matcher by one sampled token; False if the grammar rejects it."""
        accepted = state.matcher.accept_token(token_id)
        if accepted:
            state.num_accepted += 1
        return accepted


def sync(state: GrammarState, output: list[int]) -> None:
    """Bring the matcher to exactly `output` accepted: roll back extra tokens, replay missing ones."""
    matcher = state.matcher
    if not output:
        matcher.reset()
    elif state.num_accepted > len(output):
        matcher.rollback(state.num_accepted - len(output))
    else:
        for token_id in output[state.num_accepted :]:
            if not matcher.accept_token(token_id):
                logger.warning("replaying token %d into a grammar matcher failed", token_id)
                break
    state.num_accepted = len(output)
