"""Continuous batching: which sequences run this step, and how many of their tokens.

One mechanism covers prefill, chunked prefill and decode: a sequence is scheduled for
min(tokens not yet computed, budget left) tokens. Each step:

1. RUNNING sequences, oldest admission first, each takes its next chunk (1 token when decoding).
   When the block manager is out of blocks, the newest running sequence is preempted (blocks freed,
   num_computed_tokens = 0, put at the front of the queue to be recomputed later) until the current
   one fits; if it is itself the newest, it is the one preempted.
2. If nothing was preempted, queued sequences are admitted in order (preempted ones first, then by
   (priority, arrival), lower priority value first) while token budget, max_num_seqs and blocks last.
   A prefix-cache hit is taken at admission and only the uncached tokens count against the budget.
   Admission stops at the first sequence that does not fit: later ones never jump the queue, so
   nobody starves. With LoRA enabled, a sequence fits only while the running sequences' adapters plus
   its own number at most max_loras (base-model sequences count none), so every step's batch carries at
   most max_loras adapters (the LoRABatch invariant).

A sequence that still needs prompt logprobs takes no prefix-cache hit (every prompt position's logits must
be computed) and runs its prompt in chunks of at most PROMPT_LOGPROBS_CHUNK tokens, which bounds the
step's [tokens, vocab] logits (256 x 49k floats = 50 MB).

Speculative decoding (speculative_config): while the running batch holds at most disable_by_batch_size
sequences, a decoding sequence (its last token is its only uncomputed one) may speculate: besides its
token it gets lookahead slots for up to k draft tokens, within the token budget, its max_tokens and the
context, allocated with its blocks (SchedulerOutput.lookahead), and only while a token of budget and a free
block are left for each later running sequence: otherwise it decodes plainly, so speculation neither
preempts anyone nor keeps a later sequence from moving (the running list is never rotated: without that
reserve the oldest sequences' drafts would take the whole budget, step after step).
Constrained (structured-output) sequences and requests with speculative_decoding=False never speculate.
The engine then proposes and runs the entry as 1 + the drafts it got.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.core.block_manager import BlockManager, cdiv
from batchinfer.engine.core.sequence import Sequence, SequenceStatus

PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class SchedulerOutput:
    """The step's work: (sequence, number of tokens to compute) in batch order, plus what was preempted."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (row of `scheduled`, most draft tokens) of the speculating sequences; their slots are allocated
    lookahead: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Iteration-level scheduler over a running list and a (priority, arrival)-ordered queue."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, *,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        self.max_num_seqs = config.max_num_seqs
        # tokens per step: config's, or fewer where the device's forward takes fewer (worker/step_budget.py)
        self.max_num_batched_tokens = max_num_batched_tokens or config.max_num_batched_tokens
        self.max_model_len = max_model_len or config.max_model_len or 1 << 62
        self.speculative = config.speculative_config  # SpeculativeConfig | None
        self.max_loras = config.max_loras if config.enable_lora else None
        self.block_manager = block_manager
        self.running: list[Sequence] = []
        self.preempted: deque[Sequence] = deque()  # the front of the queue
        # (priority, arrival_time, insertion order, seq); aborted entries are dropped lazily at the top.
        self._waiting: list[tuple[int, float, int, Sequence]] = []
        self._order = itertools.count()
        self._num_waiting = 0  # live entries of _waiting
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        """Queued sequences, preempted ones included."""
        return self._num_waiting + len(self.preempted)

    @property
    def num_running(self) -> int:
        """Sequences holding blocks."""
        return len(self.running)

    def has_unfinished(self) -> bool:
        """True while any sequence is queued or running."""
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (WAITING)."""
        heapq.heappush(self._waiting, (seq.priority, seq.arrival_time, next(self._order), seq))
        self._num_waiting += 1

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and chunk sizes, allocating their KV slots."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        spec = self.speculative
        k = spec.num_speculative_tokens if spec and len(self.running) <= spec.disable_by_batch_size else 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.needs_prompt_logprobs:
                num_new = min(num_new, PROMPT_LOGPROBS_CHUNK)
            num_later = len(self.running) - i - 1
            lookahead = self._lookahead(seq, num_new, budget - num_later, k) if k else 0
            if lookahead and self._leaves_room(seq, num_new + lookahead, num_later) \
                    and self.block_manager.allocate_slots(seq, num_new + lookahead):
                out.lookahead.append((len(out.scheduled), lookahead))
                out.scheduled.append((seq, num_new))
                budget -= num_new + lookahead
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the newest admission
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        if out.preempted:
            return out  # blocks are short: admit nobody new this step

        loras = self._running_loras() if self.max_loras is not None else None
        while budget > 0 and len(self.running) < self.max_num_seqs:
            waiting = self._peek_waiting()
            if waiting is None:
                break
            seq = waiting
            lora = seq.lora_request
            if loras is not None and lora is not None and lora.lora_int_id not in loras:
                if self.max_loras is not None and len(loras) >= self.max_loras:
                    break  # a step carries at most max_loras adapters: wait for one to drain
                loras.add(lora.lora_int_id)
            if seq.needs_prompt_logprobs:
                hits, chunk = [], PROMPT_LOGPROBS_CHUNK
            else:
                hits, chunk = self.block_manager.get_computed_blocks(seq), budget
            num_cached = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget, chunk)
            if not self.block_manager.allocate_slots(seq, num_new, hits):
                break
            self._pop_waiting()
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

    def lora_names(self) -> tuple[list[str], list[str]]:
        """(adapters of the running sequences, adapters of the queued ones), names sorted (metrics)."""
        running = {seq.lora_request.lora_name for seq in self.running if seq.lora_request is not None}
        queued = [entry[3] for entry in self._waiting if not entry[3].is_finished] + list(self.preempted)
        waiting = {seq.lora_request.lora_name for seq in queued if seq.lora_request is not None}
        return sorted(running), sorted(waiting)

    def _running_loras(self) -> set[int]:
        """Ids of the adapters the running sequences use."""
        return {seq.lora_request.lora_int_id for seq in self.running if seq.lora_request is not None}

    def _leaves_room(self, seq: Sequence, num_tokens: int, num_later: int) -> bool:
        """True if `seq` can take num_tokens more slots and leave a free block for each later sequence."""
        bm = self.block_manager
        needed = cdiv(seq.num_computed_tokens + num_tokens, bm.block_size) - len(seq.block_table)
        return bm.num_free_blocks - max(needed, 0) >= num_later

    def _lookahead(self, seq: Sequence, num_new: int, budget: int, k: int) -> int:
        """Draft tokens `seq` may verify within `budget`: 0 unless it is decoding and allowed to speculate."""
        if num_new != 1 or seq.num_computed_tokens + 1 != len(seq.token_ids) or seq.grammar is not None \
                or not seq.params.speculative_decoding:
            return 0
        # Every verified draft may be emitted, plus one more token: stay within max_tokens and the context.
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
        return max(0, min(k, budget - 1, room))

    def free_finished(self) -> list[Sequence]:
        """Drop finished sequences from the running list and free their blocks; returns them."""
        finished = [seq for seq in self.running if seq.is_finished]
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
            for seq in finished:
                self.block_manager.free(seq)
        return finished

    def abort(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is, free its blocks and mark it FINISHED_ABORTED."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.PREEMPTED:
            self.preempted.remove(seq)
        else:
            self._num_waiting -= 1  # its heap entry is skipped when it reaches the top
        seq.status = SequenceStatus.FINISHED_ABORTED

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        self.preempted.appendleft(seq)

    def _peek_waiting(self) -> Sequence | None:
        if self.preempted:
            return self.preempted[0]
        while self._waiting and self._waiting[0][3].is_finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][3] if self._waiting else None

    def _pop_waiting(self) -> None:
        if self.preempted:
            self.preempted.popleft()
        else:
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
