"""TensorParallelRunner: the model runner the Engine uses when tensor_parallel_size > 1.

This process is rank 0: it keeps the scheduler, block manager and sampler (the Engine, unchanged) and a
ModelRunner over its slice of the weights and KV cache. It spawns ranks 1..N-1 as worker processes
(rank_processes.py: spawned, from a plain script too), each running `_worker_main`: a ModelRunner over its
own slices and a loop that waits for the next command on the StepChannel and runs it. Every step, rank 0
publishes the step layout, then runs its own forward; the ranks meet in the collectives of the layers
(one all-reduce per o_proj / down_proj and the embedding, one gather of the vocab shards of the logits).
Embeddings go the same way, one packed chunk of inputs per command: every rank runs the forward, rank 0 pools.
It implements ModelRunnerProtocol member by member; nothing is forwarded to rank 0 implicitly.

Startup order: rank 0 validates the size, starts the workers (each is handed the model the Engine
resolved, so no rank resolves it again), waits until each runs (one that dies first fails the start at
once), joins the process group (which waits for every worker to
join), then builds its ModelRunner; ModelRunner's KV sizing takes the minimum block
count over the ranks (a collective), so every rank's KV shard holds the same block ids.

Shutdown: close() (Engine.close / LLM.close, and atexit) sends an exit command, joins the workers (then
terminates stragglers) and removes the shared memory. Workers are daemonic, so they never outlive rank 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.models.resolved_model import ResolvedModel, resolve_model
from batchinfer.engine.parallel import distributed
from batchinfer.engine.parallel.rank_processes import CONTEXT, RankProcess, spawn_rank, wait_started
from batchinfer.engine.worker.embed_forward import plan_chunks
from batchinfer.engine.worker.model_runner import ModelRunner
from batchinfer.engine.worker.runner_protocol import ScheduledSequence

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess
    from multiprocessing.synchronize import Event

    from transformers import PretrainedConfig

    from batchinfer.engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


def check_tensor_parallel_size(tp_size: int, hf_config: PretrainedConfig, device: str) -> None:
    """Raise ValueError naming tensor_parallel_size when the model or machine cannot be split tp_size ways."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = hf_config.intermediate_size

    def fits(n: int) -> bool:
        return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and intermediate % n == 0

    if not fits(tp_size):
        valid = [n for n in range(1, heads + 1) if fits(n)]
        raise ValueError(
            f"tensor_parallel_size: {tp_size} cannot split the model ({heads} attention heads, {kv_heads} KV "
            f"heads, intermediate size {intermediate}); it must divide the attention heads and the "
            f"intermediate size, and divide or be a multiple of the KV heads: use one of {valid}"
        )
    if device.startswith("cuda"):
        first = int(device.split(":")[1]) if ":" in device else 0
        count = torch.cuda.device_count()
        if first + tp_size > count:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} needs CUDA devices cuda:{first}..cuda:{first + tp_size - 1}"
                f", but {count} are visible; lower tensor_parallel_size or set device"
            )


def rank_device(device: str, rank: int) -> str:
    """The device of a rank: CPU for all, or consecutive CUDA devices from the configured one."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _step_capacity_words(config: EngineConfig, max_model_len: int) -> int:
    """Upper bound of one command: a step's layout (5 words per sequence, its new tokens, its block table),
    an embeddings chunk (framed: up to max_num_batched_tokens tokens of as many inputs, or one input of up
    to max_model_len) or a LoRA adapter's name and path (4 KiB)."""
    max_blocks = math.ceil(max_model_len / config.block_size)
    step = 5 * config.max_num_seqs + config.max_num_batched_tokens + config.max_num_seqs * max_blocks
    embed_chunk = max(2 * config.max_num_batched_tokens, max_model_len + 1) + 1
    return max(step, embed_chunk, 1024)


def frame_embed_chunk(inputs: list[list[int]]) -> list[int]:
    """An embeddings chunk as one word list: [n, len_1 .. len_n, ids of input 1, ..., ids of input n]."""
    return [len(inputs), *(len(ids) for ids in inputs), *(t for ids in inputs for t in ids)]


def unframe_embed_chunk(words: list[int]) -> list[list[int]]:
    """The inputs of a framed chunk (frame_embed_chunk's inverse)."""
    n = words[0]
    out, at = [], 1 + n
    for size in words[1 : 1 + n]:
        out.append(words[at : at + size])
        at += size
    return out


def _threads_per_rank(tp_size: int) -> int:
    """CPU threads per rank: this process's torch threads, but never more than the cores split tp ways."""
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // tp_size))


class TensorParallelRunner:
    """ModelRunnerProtocol over N ranks: rank 0 here, ranks 1..N-1 in worker processes."""

    def __init__(self, config: EngineConfig, model: ResolvedModel | None = None) -> None:
        """model: resolved by the Engine (None resolves config.model here); the workers get it too."""
        if model is None:
            model = resolve_model(config, with_tokenizer=False)
        self.closed = False
        self.runner: ModelRunner | None = None
        self.workers: list[SpawnProcess] = []  # the worker ranks' processes
        self._ranks: list[RankProcess] = []
        self.channel: distributed.StepChannel | None = None
        self._joined = False
        self._loras_announced: set[int] = set()  # LoRA ids every worker rank has loaded (CMD_ADD_LORA)
        tp_size = config.tensor_parallel_size
        device = config.resolved_device()
        check_tensor_parallel_size(tp_size, model.hf_config, device)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._threads_before = torch.get_num_threads()
        threads = _threads_per_rank(tp_size)
        events = [CONTEXT.Event() for _ in range(tp_size - 1)]
        atexit.register(self.close)
        try:
            capacity = _step_capacity_words(config, model.max_model_len)
            self.channel = distributed.StepChannel(capacity, events)
            worker_model = model.without_tokenizer()  # pickled to each worker: it only runs the model
            for rank in range(1, tp_size):
                rank_config = dataclasses.replace(config, device=rank_device(device, rank))
                args = (rank_config, worker_model, rank, tp_size, backend, init_method, self.channel.name,
                        events[rank - 1], threads)
                self._ranks.append(spawn_rank(f"batchinfer-tp-rank{rank}", _worker_main, args))
                self.workers.append(self._ranks[-1].process)
            wait_started(self._ranks, what="tensor-parallel start")
            if backend == "gloo":
                torch.set_num_threads(threads)
            distributed.init_tensor_parallel(0, tp_size, backend=backend, init_method=init_method)
            self._joined = True
            self.runner = ModelRunner(dataclasses.replace(config, device=rank_device(device, 0)), model)
        except BaseException:
            self.close()
            raise

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of every rank's KV shard (ModelRunner sized them as the minimum over the ranks)."""
        return self._rank0().num_kv_blocks

    @property
    def device(self) -> torch.device:
        """Rank 0's device, where the gathered logits come back."""
        return self._rank0().device

    @property
    def step_tokens(self) -> int:
        """Rank 0's (every rank has the same config, model and share)."""
        return self._rank0().step_tokens

    def _rank0(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the tensor-parallel runner is closed")
        return self.runner

    def execute_model(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None,
        *, argmax_only_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Publish the step to the workers, run rank 0's share; float32 logits as ModelRunner's.

        argmax_only_rows is ignored: full logits (ModelRunnerProtocol allows it).
        """
        runner, channel = self._rank0(), self._channel()
        scheduled = list(scheduled)
        counts = None if logits_counts is None else list(logits_counts)
        if scheduled:
            self._check_workers_alive()
            channel.send_step(scheduled, counts)
        return runner.execute_model(scheduled, counts)

    def embed(self, token_id_lists: Sequence[list[int]]) -> list[list[float]]:
        """Every rank runs each chunk's packed pooling forward (its all-reduces need them all); rank 0 pools.

        One message per chunk (embed_forward.plan_chunks): the chunk's inputs framed as one word list."""
        runner, channel = self._rank0(), self._channel()
        vectors: list[list[float]] = [[] for _ in token_id_lists]
        for chunk in plan_chunks([len(ids) for ids in token_id_lists], runner.step_tokens):
            inputs = [list(token_id_lists[i]) for i in chunk]
            self._check_workers_alive()
            channel.send_embed(frame_embed_chunk(inputs))
            for i, vector in zip(chunk, runner.embed(inputs), strict=True):
                vectors[i] = vector
        return vectors

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check the adapter on rank 0 (its share; shapes whole), then have every worker load its share."""
        runner, channel = self._rank0(), self._channel()
        runner.add_lora(lora_request)  # a LoRAError here (or the same-id check): nothing was sent
        if lora_request.lora_int_id in self._loras_announced:
            return
        self._check_workers_alive()
        channel.send_add_lora(lora_request)
        if distributed.all_reduce_min_int(1, runner.device) != 1:
            raise ValueError(f"lora_request: a tensor-parallel rank could not load {lora_request.lora_path} "
                             "(see its log)")
        self._loras_announced.add(lora_request.lora_int_id)

    def _channel(self) -> distributed.StepChannel:
        if self.closed or self.channel is None:
            raise RuntimeError("the tensor-parallel runner is closed")
        return self.channel

    def _check_workers_alive(self) -> None:
        dead = [p.name for p in self.workers if not p.is_alive()]
        if dead:
            raise RankFailedError(f"tensor-parallel worker(s) {', '.join(dead)} died; see their log above")

    def close(self) -> None:
        """Stop the workers, leave the process group, free the shared memory (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.channel is not None:
            self.channel.send_exit()
        for process in self.workers:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                logger.warning("tensor-parallel worker %s did not exit; terminating it", process.name)
                process.terminate()
                process.join(5)
        if self.channel is not None:
            self.channel.close()
        if self._joined:
            distributed.destroy_tensor_parallel()
        torch.set_num_threads(self._threads_before)
        self.runner = None


def _worker_main(
    config: EngineConfig,
    model: ResolvedModel,
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    shm_name: str,
    event: Event,
    threads: int,
) -> None:
    """A worker rank: join the group, build this rank's ModelRunner, run steps until told to exit."""
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    if backend == "gloo":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(torch.device(config.resolved_device()))
    distributed.init_tensor_parallel(rank, world_size, backend=backend, init_method=init_method)
    channel = distributed.StepChannel(0, [], name=shm_name)
    try:
        runner = ModelRunner(config, model)
        while (command := channel.receive(event)) is not None:
            try:
                if isinstance(command, distributed.AddLoRA):
                    loaded = 0
                    try:
                        runner.add_lora(command.request)
                        loaded = 1
                    finally:  # rank 0 waits in this collective: join it whatever happened
                        distributed.all_reduce_min_int(loaded, runner.device)
                elif isinstance(command, distributed.EmbedInput):
                    runner.embed(unframe_embed_chunk(command.token_ids))
                else:
                    runner.execute_model(*command)
            except ValueError:
                # A malformed step fails the same check on rank 0 before any collective: skip it, stay
                # in step.
                logger.exception("step rejected")
    finally:
        channel.close()
        distributed.destroy_tensor_parallel()
