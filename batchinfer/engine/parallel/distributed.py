"""Tensor-parallel plumbing: who am I (rank, world size), the collectives the layers call, and the
shared-memory channel that carries each step's batch layout from the engine process to the workers.

Rank 0 is the engine process (scheduler, block manager, sampler); ranks 1..N-1 are worker processes that
only run the model. Every rank holds a slice of every weight and of the KV cache, so every rank runs
every step: rank 0 writes the step's flat int32 arrays into a SharedMemory buffer and sets one Event per
worker (nano-vllm's ModelRunner design, minus the pickle). A worker has read the buffer before it joins
the step's first collective, and rank 0 writes the next step only after the last collective of this one,
so one buffer suffices. An embeddings chunk travels the same way (CMD_EMBED, its framed inputs: count,
lengths, token ids; tp_runner.py frames it): every rank runs the pooling forward, whose all-reduces need
them all. A LoRA adapter is announced once (CMD_ADD_LORA:
its id, name and path); each rank loads its share, and a step's sequences carry their adapter's id. No
collective follows an announcement, so every rank joins one all_reduce_min_int after it (rank 0 learns
whether all of them loaded it, and writes nothing before they have read it).

Under pipeline parallelism (pp_stage.py) each stage's ranks form a subgroup: use_tensor_parallel_group
points the collectives at it, and the gathered logits land on the stage's first rank (the leader).

Collective timing (seconds on this rank, including waits for slower peers) is accumulated in COMM_STATS
for bench/tp_comm.py; two perf_counter calls per collective cost nothing next to the collective.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

    from batchinfer.engine.lora.request import LoRARequest
    from batchinfer.engine.worker.runner_protocol import ScheduledSequence

# Step channel commands (header word 0).
CMD_STEP = 1
CMD_EXIT = 2
CMD_EMBED = 3  # one embeddings chunk: [cmd, 0, W, 0] then W words (tp_runner.py's framed inputs)
CMD_ADD_LORA = 4  # a LoRA adapter: [cmd, lora_int_id, n bytes, 0] then JSON [name, path] (utf-8) in words
_META = 5  # words per scheduled sequence: computed, new, blocks, logits count, LoRA id (0: the base model)
_HEADER = 4  # cmd, num_seqs, num_tokens, num_block_ids
# A collective that waits longer than this means a peer died mid-step: fail instead of hanging forever.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class _TPState:
    rank: int = 0
    world_size: int = 1
    # Under pipeline parallelism: this stage's group (None = the default group) and its rank 0's global rank.
    group: dist.ProcessGroup | None = None
    leader: int = 0


_STATE = _TPState()


@dataclass
class CommStats:
    """Seconds this rank spent in collectives and in step broadcasts, and how many of each."""

    all_reduce_s: float = 0.0
    all_reduce_calls: int = 0
    gather_s: float = 0.0
    gather_calls: int = 0
    broadcast_s: float = 0.0
    broadcast_calls: int = 0


COMM_STATS = CommStats()


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 = the engine process)."""
    return _STATE.rank


def tp_world_size() -> int:
    """Number of tensor-parallel ranks (1 = no tensor parallelism)."""
    return _STATE.world_size


def init_tensor_parallel(rank: int, world_size: int, *, backend: str, init_method: str) -> None:
    """Join the process group (blocks until every rank has joined) and record rank / world size."""
    if _STATE.world_size != 1:
        raise RuntimeError(
            "a tensor-parallel engine is already running in this process; close() it before starting another"
        )
    if world_size > 1:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
        )
    _STATE.rank, _STATE.world_size = rank, world_size


def use_tensor_parallel_group(
    group: dist.ProcessGroup | None, rank: int, world_size: int, *, leader: int
) -> None:
    """Make `group` (one pipeline stage's ranks, already created) the one the layers' collectives use."""
    if _STATE.world_size != 1:
        raise RuntimeError("a tensor-parallel engine is already running in this process; close() it first")
    _STATE.rank, _STATE.world_size, _STATE.group, _STATE.leader = rank, world_size, group, leader


def destroy_tensor_parallel() -> None:
    """Leave the process group (and its subgroups); this process is a single rank again."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.world_size, _STATE.group, _STATE.leader = 0, 1, None, 0


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum tensor over all ranks, in place (no-op without tensor parallelism)."""
    if _STATE.world_size == 1:
        return tensor
    start = time.perf_counter()
    dist.all_reduce(tensor, group=_STATE.group)
    COMM_STATS.all_reduce_s += time.perf_counter() - start
    COMM_STATS.all_reduce_calls += 1
    return tensor


def gather_last_dim(tensor: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's tensor along the last dim on (tensor-parallel) rank 0; others get None."""
    if _STATE.world_size == 1:
        return tensor
    start = time.perf_counter()
    tensor = tensor.contiguous()
    if _STATE.rank == 0:
        parts = [torch.empty_like(tensor) for _ in range(_STATE.world_size)]
        dist.gather(tensor, parts, dst=_STATE.leader, group=_STATE.group)
        result: torch.Tensor | None = torch.cat(parts, dim=-1)
    else:
        dist.gather(tensor, None, dst=_STATE.leader, group=_STATE.group)
        result = None
    COMM_STATS.gather_s += time.perf_counter() - start
    COMM_STATS.gather_calls += 1
    return result


def all_reduce_min_int(value: int, device: torch.device) -> int:
    """The minimum of value over all (tensor-parallel) ranks (every rank gets it)."""
    if _STATE.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_STATE.group)
    return int(tensor.item())


class StepChannel:
    """Rank 0 -> workers: one step's batch layout as flat int32 arrays in shared memory, plus an Event each.

    Layout (int32): [cmd, S, T, B] then per sequence (num_computed_tokens, num_new, num_blocks,
    logits_count, lora_int_id) [5S], the new token ids [T], and the sequences' block tables concatenated [B].
    A worker's channel keeps the adapters announced to it (`loras`) to give its sequences their request.
    """

    def __init__(self, capacity_words: int, events: list[Event], name: str | None = None) -> None:
        size = (_HEADER + capacity_words) * 4
        self.owner = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=size if self.owner else 0)
        self.words = np.ndarray((self.shm.size // 4,), dtype=np.int32, buffer=self.shm.buf)
        self.events = events
        self.loras: dict[int, LoRARequest] = {}  # worker: lora_int_id -> LoRARequest announced (CMD_ADD_LORA)

    @property
    def name(self) -> str:
        """The shared-memory segment's name (workers attach by it)."""
        return self.shm.name

    def send_step(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None
    ) -> None:
        """Rank 0: publish a step (list of (seq, num_new), and the logits asked per entry) to every worker."""
        start = time.perf_counter()
        meta: list[int] = []
        tokens: list[int] = []
        blocks: list[int] = []
        for i, (seq, num_new) in enumerate(scheduled):
            begin = seq.num_computed_tokens
            if num_new < 1 or begin + num_new > len(seq.token_ids):
                # Fail here, before the workers enter the forward and wait on a collective rank 0 never joins.
                raise ValueError(
                    f"scheduled {num_new} tokens from position {begin} of a sequence with "
                    f"{len(seq.token_ids)} tokens: need 1 <= n <= len(token_ids) - num_computed_tokens"
                )
            lora = getattr(seq, "lora_request", None)
            meta += (begin, num_new, len(seq.block_table), 1 if logits_counts is None else logits_counts[i],
                     0 if lora is None else lora.lora_int_id)
            tokens += seq.token_ids[begin : begin + num_new]
            blocks += seq.block_table
        total = _HEADER + len(meta) + len(tokens) + len(blocks)
        if total > len(self.words):
            raise ValueError(f"step layout needs {total} words; the step channel holds {len(self.words)}")
        w = self.words
        w[:_HEADER] = (CMD_STEP, len(scheduled), len(tokens), len(blocks))
        offset = _HEADER
        for part in (meta, tokens, blocks):
            w[offset : offset + len(part)] = part
            offset += len(part)
        for event in self.events:
            event.set()
        COMM_STATS.broadcast_s += time.perf_counter() - start
        COMM_STATS.broadcast_calls += 1

    def send_embed(self, token_ids: list[int]) -> None:
        """Rank 0: publish one embeddings chunk (framed words); every worker runs the pooling forward."""
        total = _HEADER + len(token_ids)
        if total > len(self.words):
            raise ValueError(f"an embeddings chunk of {len(token_ids)} words needs {total}; the step channel "
                             f"holds {len(self.words)}")
        self.words[:_HEADER] = (CMD_EMBED, 0, len(token_ids), 0)
        self.words[_HEADER:total] = token_ids
        for event in self.events:
            event.set()

    def send_add_lora(self, request: LoRARequest) -> None:
        """Rank 0: announce a LoRA adapter (a LoRARequest); then join all_reduce_min_int with the workers."""
        data = json.dumps([request.lora_name, request.lora_path]).encode()
        words = np.frombuffer(data + bytes(-len(data) % 4), dtype=np.int32)
        total = _HEADER + len(words)
        if total > len(self.words):
            raise ValueError(f"lora_request: its name and path take {len(data)} bytes; the step channel "
                             f"holds {len(self.words) * 4}")
        self.words[:_HEADER] = (CMD_ADD_LORA, request.lora_int_id, len(data), 0)
        self.words[_HEADER:total] = words
        for event in self.events:
            event.set()

    def send_exit(self) -> None:
        """Rank 0: tell every worker to leave its loop."""
        self.words[0] = CMD_EXIT
        for event in self.events:
            event.set()

    def receive(
        self, event: Event
    ) -> tuple[list[tuple[StepSequence, int]], list[int]] | EmbedInput | AddLoRA | None:
        """Worker: wait for the next command: a step ((stand-in sequence, num_new) list and logits counts),
        an embeddings input, a LoRA adapter, or None (exit)."""
        event.wait()
        event.clear()
        w = self.words
        cmd, num_seqs, num_tokens, num_blocks = (int(x) for x in w[:_HEADER])
        if cmd == CMD_EXIT:
            return None
        if cmd == CMD_EMBED:
            return EmbedInput(w[_HEADER : _HEADER + num_tokens].tolist())
        if cmd == CMD_ADD_LORA:
            from batchinfer.engine.lora.request import LoRARequest

            lora_id, size = num_seqs, num_tokens
            name, path = json.loads(w[_HEADER : _HEADER + -(-size // 4)].tobytes()[:size])
            self.loras[lora_id] = LoRARequest(name, lora_id, path)
            return AddLoRA(self.loras[lora_id])
        offset = _HEADER
        meta = w[offset : offset + _META * num_seqs].tolist()
        offset += _META * num_seqs
        tokens = w[offset : offset + num_tokens].tolist()
        offset += num_tokens
        blocks = w[offset : offset + num_blocks].tolist()
        scheduled: list[tuple[StepSequence, int]] = []
        counts: list[int] = []
        token_at = block_at = 0
        for i in range(num_seqs):
            begin, num_new, nb, count, lora_id = meta[_META * i : _META * (i + 1)]
            counts.append(count)
            window = _TokenWindow(begin, tokens[token_at : token_at + num_new])
            seq = StepSequence(window, begin, blocks[block_at : block_at + nb], self.loras.get(lora_id))
            scheduled.append((seq, num_new))
            token_at += num_new
            block_at += nb
        return scheduled, counts

    def close(self) -> None:
        """Detach (and, on rank 0, remove) the shared-memory segment."""
        del self.words
        self.shm.close()
        if self.owner:
            self.shm.unlink()


@dataclass
class AddLoRA:
    """A LoRA adapter announced to a worker rank: it loads its share (then joins all_reduce_min_int)."""

    request: LoRARequest


@dataclass
class EmbedInput:
    """One embeddings input a worker rank runs its share of the pooling forward over."""

    token_ids: list[int]


class _TokenWindow:
    """Stands in for seq.token_ids on a worker: it knows only the tokens of this step, at their positions."""

    __slots__ = ("begin", "new")

    def __init__(self, begin: int, new: list[int]) -> None:
        self.begin, self.new = begin, new

    def __len__(self) -> int:
        return self.begin + len(self.new)

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.start != self.begin or index.stop != len(self):
            raise IndexError("a worker's token window holds only this step's new tokens")
        return self.new


@dataclass
class StepSequence:
    """The Sequence fields the model runner reads (ARCHITECTURE.md, contract 2), rebuilt on a worker."""

    token_ids: _TokenWindow
    num_computed_tokens: int
    block_table: list[int]
    lora_request: LoRARequest | None = None  # announced under the step's LoRA id (None: the base model)
