"""GrammarBackend: structured output in the engine, on xgrammar (vLLM's default grammar backend).

- Compile: each distinct constraint (StructuredOutputsParams.cache_key, a hash) is compiled against the
  tokenizer once, on a pool of `compile_workers` threads, so a new schema never stalls the step. The pool
  is fair between owners (the request's cache_salt, which the worker sets per owner): owners take turns,
  and one named owner compiles on at most all threads but one, so a tenant's slow grammars (a 750 KB choice
  list: ~8 s) never hold up another's. A compilation running past `compile_timeout_s` errors its
  requests, naming grammar_compile_timeout_seconds (xgrammar cannot be interrupted: the thread finishes
  it and drops it; the constraint is remembered as failed, so it is not compiled again).
  Compiled grammars stay in an LRU bounded in bytes (`cache_bytes`, xgrammar's memory_size_bytes).
  A request whose grammar is still compiling waits outside the scheduler (llm_engine.py).
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

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

import torch
from cachetools import LRUCache

from batchinfer.engine.sampling.grammar_state import GrammarState as GrammarState  # re-exported (engine)
from batchinfer.engine.sampling.grammars import DEFAULT_GRAMMAR_BUDGET, GrammarError, build_grammar
from batchinfer.engine.sampling_params import StructuredOutputsParams
from batchinfer.fair_pool import FairPool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from xgrammar import CompiledGrammar

    from batchinfer.engine.core.sequence import Sequence

logger = logging.getLogger(__name__)

COMPILE_WORKERS = 2  # compile threads (setting grammar_compile_workers): a slow grammar leaves one free
COMPILE_TIMEOUT_S = DEFAULT_GRAMMAR_BUDGET.timeout_s  # setting grammar_compile_timeout_seconds
# xgrammar's threads within one compilation, and filling the batch's bitmask rows (~20-90 us a row at
# vocab 49k, one thread): half the cores, 2 to 8.
XGRAMMAR_THREADS = min(8, max(2, (os.cpu_count() or 2) // 2))
# Below this many constrained rows the bitmask is filled on the calling thread: waking fill threads costs
# more than it saves (measured ~4 ms a step for 4 rows on a loaded 2-core machine, 0.1 ms inline).
PARALLEL_FILL_ROWS = 64
COMPILED_CACHE_BYTES = 512 << 20  # compiled grammars kept for reuse (setting compiled_grammar_cache_bytes)
FAILED_CACHE_BYTES = 1 << 20  # constraints that failed or timed out: their errors, by cache key


class _Job(NamedTuple):
    key: str
    constraint: StructuredOutputsParams
    future: Future[CompiledGrammar]


class GrammarBackend:
    """Compiles constraints for one tokenizer and keeps the step's token bitmask."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,  # xgrammar reads its whole vocabulary and decoder
        *,
        vocab_size: int,
        eos_token_ids: AbstractSet[int],
        max_num_seqs: int,
        device: str | torch.device = "cpu",
        compile_workers: int = COMPILE_WORKERS,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        cache_bytes: int = COMPILED_CACHE_BYTES,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size  # the model's logits width
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        # Our LRU is the cache: xgrammar's own would keep a second copy of each grammar.
        self.compiler = xgr.GrammarCompiler(info, max_threads=XGRAMMAR_THREADS, cache_enabled=False)
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[CompiledGrammar]] = {}  # queued or compiling, by cache key
        # Owners with a job queued for an in-flight key, and the in-flight futures whose compile began: an
        # owner asking for a key another owner's queue holds gets its own job in its own turn (the first
        # to start compiles), so a tenant cannot hold up a common constraint behind its backlog.
        self._queued_for: dict[str, set[str]] = {}
        self._started: set[Future[CompiledGrammar]] = set()
        # done futures: compile() hands out one
        self._compiled: LRUCache[str, Future[CompiledGrammar]] = LRUCache(
            maxsize=cache_bytes, getsizeof=lambda done: _grammar_bytes(done.result()))
        self._failed: LRUCache[str, str] = LRUCache(maxsize=FAILED_CACHE_BYTES,
                                                    getsizeof=lambda error: 200 + len(error))
        # Owners take turns; at exit a compilation still running is waited for (budgeted in size, it ends).
        self._pool = FairPool(compile_workers, name="batchinfer-grammar")
        self.bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        if torch.device(device).type == "cuda":
            self.bitmask = self.bitmask.pin_memory()  # copied to the GPU every step, asynchronously
        self._fill_inline = xgr.BatchGrammarMatcher(max_threads=1)
        self._fill_parallel = xgr.BatchGrammarMatcher(max_threads=XGRAMMAR_THREADS)
        self.num_compiled = 0
        self.compile_seconds = 0.0  # summed over compilations, in the compile threads

    def close(self, *, wait: bool = True) -> None:
        """Stop compiling: queued compilations are cancelled; with `wait`, a running one is waited for
        (up to the compile timeout: xgrammar cannot be interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for future in self._inflight.values():
                future.cancel()
            self._inflight.clear()
            self._queued_for.clear()
        if wait:
            self._pool.shutdown(timeout=self.compile_timeout_s)

    @property
    def cached_bytes(self) -> int:
        """Bytes of compiled grammars the cache holds (xgrammar's estimate)."""
        with self._lock:
            return int(self._compiled.currsize)

    def compile(self, constraint: StructuredOutputsParams, *,
                owner: str | None = None) -> Future[CompiledGrammar]:
        """The compiled grammar of `constraint`, as a future: queued for `owner` unless cached or under way
        (a constraint that failed or timed out fails again at once)."""
        key, owner = constraint.cache_key, owner or ""
        with self._lock:
            future = self._compiled.get(key) or self._inflight.get(key)
            error = self._failed.get(key) if future is None else None
            if future is None and error is None:
                future = self._inflight[key] = Future()
                self._queued_for[key] = set()
            queued_for = self._queued_for.get(key)
            if future is not None and queued_for is not None and owner not in queued_for \
                    and future not in self._started:
                queued_for.add(owner)
                with contextlib.suppress(RuntimeError):  # closed: the future stays pending, like a cancel
                    self._pool.submit(owner, self._run, _Job(key, constraint, future))
        if future is not None:
            return future
        failed: Future[CompiledGrammar] = Future()
        failed.set_exception(GrammarError(error))
        return failed

    def _run(self, job: _Job) -> None:
        """Compile one job on a pool thread, within the timeout (module docstring)."""
        with self._lock:
            if job.future.done() or job.future in self._started:  # cancelled, or another owner's job began
                return
            self._started.add(job.future)
        timer = threading.Timer(self.compile_timeout_s, self._expire, (job,))
        timer.daemon = True
        timer.start()
        try:
            compiled, error = self._compile(job.constraint), None
        except Exception as exc:  # noqa: BLE001 - handed to the requests waiting on it
            compiled, error = None, exc
        timer.cancel()
        with self._lock:
            self._started.discard(job.future)
            if self._inflight.get(job.key) is job.future:
                del self._inflight[job.key]
                self._queued_for.pop(job.key, None)
            if not job.future.done():
                if error is None:
                    assert compiled is not None  # _compile returned
                    job.future.set_result(compiled)
                    with contextlib.suppress(ValueError):  # larger than the whole cache: not kept
                        self._compiled[job.key] = job.future
                else:
                    self._failed[job.key] = str(error)
                    job.future.set_exception(error)

    def _expire(self, job: _Job) -> None:
        """A compilation past its time: its requests error now; the thread finishes it and drops it."""
        error = (f"compiling the {job.constraint.kind} constraint took longer than "
                 f"{self.compile_timeout_s:g} s (grammar_compile_timeout_seconds); simplify it")
        with self._lock:
            if job.future.done():
                return
            if self._inflight.get(job.key) is job.future:
                del self._inflight[job.key]
                self._queued_for.pop(job.key, None)
            self._failed[job.key] = error
            job.future.set_exception(GrammarError(error))
        logger.warning("grammar %s: %s", job.key[:12], error)

    def _compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
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
            assert state is not None and state.matcher is not None  # a constrained, started row
            if state.num_accepted != seq.num_output_tokens:
                sync(state, seq.output_token_ids)
            states.append(state.matcher)
        filler = self._fill_parallel if len(rows) >= PARALLEL_FILL_ROWS else self._fill_inline
        filler.batch_fill_next_token_bitmask(states, self.bitmask, rows)
        return self.bitmask

    def accept(self, state: GrammarState, token_id: int) -> bool:
        """Advance the matcher by one sampled token; False if the grammar rejects it."""
        assert state.matcher is not None  # started
        accepted = state.matcher.accept_token(token_id)
        if accepted:
            state.num_accepted += 1
        return accepted


def _grammar_bytes(compiled: CompiledGrammar) -> int:
    """What a compiled grammar costs the cache: xgrammar's own estimate (its token masks dominate)."""
    return max(int(getattr(compiled, "memory_size_bytes", 0) or 0), 1024)


def sync(state: GrammarState, output: list[int]) -> None:
    """Bring the matcher to exactly `output` accepted: roll back extra tokens, replay missing ones."""
    matcher = state.matcher
    assert matcher is not None  # started
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
