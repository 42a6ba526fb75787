"""PipelineParallelRunner: the model runner the Engine uses when pipeline_parallel_size > 1 (or the Ray
executor is chosen); it implements ModelRunnerProtocol member by member, like TensorParallelRunner.
Embeddings are refused at once (EMBEDDINGS_NEED_ONE_STAGE): the pooled hidden state lives on no stage.

The layers are split into pipeline_parallel_size stages of near-equal layer counts; each stage runs on
tensor_parallel_size ranks (pp_stage.py has the topology and the wire format). This process is rank 0:
it keeps the scheduler, block manager and sampler (the Engine, unchanged) and runs stage 0's share.

Stages overlap inside one step (GPipe-style): execute_model splits the step's entries into up to
pp_size micro-batches by sequence (contiguous, near-equal in tokens, at least MIN_MICRO_BATCH_TOKENS
tokens each, so a small decode step stays whole), and rank 0 pushes micro-batch m+1
through stage 0 while stage 1 runs micro-batch m; then it collects each micro-batch's logits from the
last stage, in order. That is how the in-flight batches are accounted for: they all belong to one
scheduled step, so the scheduler and block manager see an ordinary step, and a step's KV writes are
done (on every stage) before its logits come back. The bubble (stage s idle while the pipeline fills
and drains) is measured by bench/pp_comm.py.

Startup: rank 0 checks the sizes, starts ranks 1..N-1 (spawned processes here, rank_processes.py, from a
plain script too; Ray actors with distributed_executor_backend="ray"), joins the process group, then
builds its StageRunner; the stages agree on the smallest KV block count. Faults: a dead or stuck rank
makes execute_model raise RankFailedError naming it within seconds (STEP_TIMEOUT_S at most); the runner
stays failed, and close() terminates the remaining ranks.
"""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.models.pipeline_stage import split_layers
from batchinfer.engine.models.resolved_model import ResolvedModel, resolve_model
from batchinfer.engine.parallel.distributed import CMD_EXIT, CMD_STEP
from batchinfer.engine.parallel.pp_stage import (
    PIPE_STATS,
    StageRunner,
    Topology,
    destroy_pipeline,
    encode_layout,
    header,
    init_pipeline,
    wait_for,
)
from batchinfer.engine.parallel.rank_processes import RankProcess, spawn_rank, wait_started
from batchinfer.engine.parallel.tp_runner import _free_port, check_tensor_parallel_size, rank_device
from batchinfer.engine.worker.runner_protocol import (
    EMBEDDINGS_NEED_ONE_STAGE,
    LORA_NEEDS_ONE_RANK,
    ScheduledSequence,
)
from batchinfer.engine.worker.step_batch import check_entry, check_logits_count

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess

    from transformers import PretrainedConfig

    from batchinfer.engine.lora.request import LoRARequest
    from batchinfer.engine.parallel.ray_executor import RayLauncher

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
# A micro-batch re-reads all of its stage's weights, so splitting a small (weight-bound) step costs more
# than the overlap gains: a step is split only into micro-batches of at least this many tokens
# (bench/pp_comm.py: on CPU, SmolLM2 decoding 8 sequences takes 98 ms split in two, 68 ms whole).
MIN_MICRO_BATCH_TOKENS = 32
# After a link error, how long to wait for the dead rank's process to be reported gone (to name it).
DEATH_NOTICE_S = 2.0


def check_pipeline_parallel_size(config: EngineConfig, hf_config: PretrainedConfig) -> None:
    """Raise ValueError naming pipeline_parallel_size when the model or machine cannot be split so."""
    layers = hf_config.num_hidden_layers
    if config.pipeline_parallel_size > layers:
        raise ValueError(
            f"pipeline_parallel_size: {config.pipeline_parallel_size} stages need at least as many layers; "
            f"the model has {layers}"
        )
    device = config.resolved_device()
    world = config.pipeline_parallel_size * config.tensor_parallel_size
    if device.startswith("cuda") and config.distributed_executor_backend == "mp":
        first = int(device.split(":")[1]) if ":" in device else 0
        if first + world > torch.cuda.device_count():
            raise ValueError(
                f"pipeline_parallel_size x tensor_parallel_size = {world} ranks need CUDA devices "
                f"cuda:{first}..cuda:{first + world - 1}, but {torch.cuda.device_count()} are visible; use "
                "distributed_executor_backend='ray' to spread the ranks over several machines"
            )


def split_micro_batches(num_new: list[int], parts: int) -> list[tuple[int, int]]:
    """At most `parts` contiguous, non-empty ranges [a, b) of the entries, near-equal in tokens."""
    parts = max(1, min(parts, len(num_new)))
    cumulative = list(itertools.accumulate(num_new))
    cuts = [0]
    for k in range(1, parts):
        wanted = bisect.bisect_left(cumulative, cumulative[-1] * k / parts) + 1
        cuts.append(max(cuts[-1] + 1, min(wanted, len(num_new) - (parts - k))))
    cuts.append(len(num_new))
    return list(itertools.pairwise(cuts))


def check_step(
    scheduled: list[tuple[ScheduledSequence, int]], counts: list[int], max_model_len: int, block_size: int
) -> None:
    """ModelRunner's checks of a step, made before any micro-batch leaves rank 0 (a half-sent step would
    leave the stages out of step)."""
    if len(counts) != len(scheduled):
        raise ValueError(f"logits_counts has {len(counts)} entries for a step of {len(scheduled)} sequences")
    for (seq, num_new), count in zip(scheduled, counts, strict=True):
        check_entry(seq, num_new, block_size=block_size, max_model_len=max_model_len)
        check_logits_count(count, num_new)


class PipelineParallelRunner:
    """ModelRunnerProtocol over pp x tp ranks: stage 0's tp rank 0 here, the others in their processes."""

    def __init__(self, config: EngineConfig, model: ResolvedModel | None = None) -> None:
        """model: resolved by the Engine (None resolves config.model here); every rank gets it."""
        if model is None:
            model = resolve_model(config, with_tokenizer=False)
        self.closed = False
        self.failed: RankFailedError | None = None
        self.runner: StageRunner | None = None
        self._joined = False
        self._serving = False  # every rank built its stage and waits for steps
        self.topology = Topology(config.tensor_parallel_size, config.pipeline_parallel_size)
        device = config.resolved_device()
        check_tensor_parallel_size(config.tensor_parallel_size, model.hf_config, "cpu")
        check_pipeline_parallel_size(config, model.hf_config)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        self.vocab_size = model.hf_config.vocab_size
        self._threads_before = torch.get_num_threads()
        self.launcher = _make_launcher(config)
        atexit.register(self.close)
        try:
            worker_model = model.without_tokenizer()  # sent to each rank: it only runs the model
            init_method = self.launcher.start(config, worker_model, self.topology, backend)
            if backend == "gloo":
                torch.set_num_threads(self.launcher.threads_per_rank)
            self.groups = init_pipeline(0, self.topology, backend=backend, init_method=init_method)
            self._joined = True
            stage = split_layers(model.hf_config.num_hidden_layers, self.topology.pp_size, 0)
            rank0_config = dataclasses.replace(config, device=rank_device(device, 0))
            self.runner = StageRunner(rank0_config, model, stage)
        except BaseException as exc:
            dead = self.launcher.dead_ranks() if isinstance(exc, RuntimeError) else {}
            self.close()
            if dead:
                who = ", ".join(f"{self.topology.describe(r)} ({why})" for r, why in sorted(dead.items()))
                raise RankFailedError(f"pipeline-parallel {who} died while starting; see its log") from exc
            raise
        self._serving = True
        self.num_micro_batches = self.topology.pp_size
        self.min_micro_batch_tokens = MIN_MICRO_BATCH_TOKENS
        tp = self.topology.tp_size
        self._stage0_peers = list(range(1, tp))
        self._next_rank = self.topology.rank(1, 0) if self.topology.pp_size > 1 else None
        self._last_rank = self.topology.rank(self.topology.pp_size - 1, 0)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of every stage's KV cache (the stages agreed on the smallest count)."""
        return self._rank0().num_kv_blocks

    @property
    def device(self) -> torch.device:
        """Rank 0's device, where the logits come back."""
        return self._rank0().device

    @property
    def step_tokens(self) -> int:
        """Rank 0's (every stage has the same config and MLP width)."""
        return self._rank0().step_tokens

    def _rank0(self) -> StageRunner:
        if self.runner is None:
            raise RuntimeError("the pipeline-parallel runner is closed")
        return self.runner

    def embed(self, token_id_lists: Sequence[list[int]]) -> list[list[float]]:
        """Refused at once, before any rank is involved: no single stage holds the final hidden state."""
        raise ValueError(EMBEDDINGS_NEED_ONE_STAGE)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Refused: adapters run on one rank (EngineConfig refuses enable_lora here before this)."""
        raise ValueError(LORA_NEEDS_ONE_RANK)

    def execute_model(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None,
        *, argmax_only_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Run one step through every stage; float32 logits as ModelRunner's.

        argmax_only_rows is ignored: full logits (ModelRunnerProtocol allows it).
        """
        runner = self._rank0()
        if self.failed is not None:
            raise self.failed
        if not scheduled:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=runner.device)
        scheduled = list(scheduled)
        counts = [1] * len(scheduled) if logits_counts is None else list(logits_counts)
        check_step(scheduled, counts, runner.max_model_len, runner.block_size)
        dead = self.launcher.dead_ranks()
        if dead:
            self._fail(RuntimeError("found dead before the step"), dead)
        try:
            return self._run_step(runner, scheduled, counts)
        except (RuntimeError, OSError) as exc:  # gloo link errors and timeouts
            self._fail(exc, self._wait_for_death())

    def _run_step(
        self, runner: StageRunner, scheduled: list[tuple[ScheduledSequence, int]], counts: list[int]
    ) -> torch.Tensor:
        control = self.groups.control
        sends: list[tuple[dist.Work | None, torch.Tensor]] = []  # in flight, with the tensors they read
        logits: list[torch.Tensor] = []
        num_new = [n for _, n in scheduled]
        parts = min(self.num_micro_batches, max(1, sum(num_new) // self.min_micro_batch_tokens))
        chunks = split_micro_batches(num_new, parts)
        for start, end in chunks:
            begin = time.perf_counter()
            layout = encode_layout(scheduled[start:end], counts[start:end])
            head = header(CMD_STEP, layout.numel())
            for peer in self._stage0_peers:
                sends += [(dist.isend(head, dst=peer, group=control), head),
                          (dist.isend(layout, dst=peer, group=control), layout)]
            computed = time.perf_counter()
            out = runner.run_stage(scheduled[start:end], counts[start:end], None).contiguous()
            sent = time.perf_counter()
            PIPE_STATS.stage_s += sent - computed
            if self._next_rank is None:  # one stage (the Ray executor with tp only): these are the logits
                logits.append(out)
                continue
            head = header(CMD_STEP, layout.numel(), out)  # the rows and dtype stage 1 is to receive
            sends += [(dist.isend(head, dst=self._next_rank, group=control), head),
                      (dist.isend(layout, dst=self._next_rank, group=control), layout),
                      (dist.isend(out, dst=self._next_rank), out)]
            PIPE_STATS.send_s += time.perf_counter() - sent + computed - begin
        waiting = time.perf_counter()
        if self._next_rank is not None:
            last = self.topology.describe(self._last_rank)
            for start, end in chunks:
                rows = torch.empty(sum(counts[start:end]), self.vocab_size, dtype=torch.float32,
                                   device=runner.device)
                wait_for(dist.irecv(rows, src=self._last_rank), f"logits from {last}")
                logits.append(rows)
        for work, _ in sends:
            wait_for(work, "sending a micro-batch")
        PIPE_STATS.logits_wait_s += time.perf_counter() - waiting
        PIPE_STATS.steps += 1
        PIPE_STATS.micro_batches += len(chunks)
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def _wait_for_death(self) -> dict[int, str]:
        """The ranks reported dead, waiting briefly: a link error can arrive before the process is reaped."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while not (dead := self.launcher.dead_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def _fail(self, exc: BaseException, dead: dict[int, str]) -> NoReturn:
        if dead:
            who = ", ".join(f"{self.topology.describe(rank)} ({why})" for rank, why in sorted(dead.items()))
            message = f"pipeline-parallel {who} died; the engine cannot continue ({exc})"
        else:
            message = f"a pipeline-parallel rank stopped answering; the engine cannot continue ({exc})"
        self.failed = RankFailedError(message)
        logger.error("%s", message)
        raise self.failed from exc

    def close(self) -> None:
        """Stop the other ranks, leave the process group (idempotent); after a failure, terminate them."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        orderly = self._serving and self.failed is None
        if orderly:
            try:
                exit_head = header(CMD_EXIT)
                for peer in self._exit_targets():
                    wait_for(dist.isend(exit_head, dst=peer, group=self.groups.control), "exit command")
            except RuntimeError:
                logger.warning("could not tell every rank to exit; terminating them")
                orderly = False
        self.launcher.stop(JOIN_TIMEOUT_S if orderly else 0.0)
        if self._joined:
            destroy_pipeline()
        torch.set_num_threads(self._threads_before)
        self.runner = None

    def _exit_targets(self) -> list[int]:
        """Who rank 0 tells to exit: its stage's peers and stage 1's tp rank 0 (which passes it on)."""
        peers = list(range(1, self.topology.tp_size))
        return peers + ([self.topology.rank(1, 0)] if self.topology.pp_size > 1 else [])


def _make_launcher(config: EngineConfig) -> ProcessLauncher | RayLauncher:
    if config.distributed_executor_backend == "ray":
        from batchinfer.engine.parallel.ray_executor import RayLauncher

        return RayLauncher()
    return ProcessLauncher()


class ProcessLauncher:
    """Ranks 1..N-1 as local processes (rank_processes.py: spawned, never forked)."""

    def __init__(self) -> None:
        self.processes: list[SpawnProcess] = []
        self._ranks: list[RankProcess] = []
        self.threads_per_rank = 1

    def start(self, config: EngineConfig, model: ResolvedModel, topology: Topology, backend: str) -> str:
        """Start every non-driver rank; the init_method they join."""
        from batchinfer.engine.parallel.pp_stage import worker_main
        from batchinfer.engine.parallel.tp_runner import _threads_per_rank

        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.threads_per_rank = _threads_per_rank(topology.world_size)
        device = config.resolved_device()
        for rank in range(1, topology.world_size):
            rank_config = dataclasses.replace(config, device=rank_device(device, rank))
            args = (rank_config, model, rank, topology, backend, init_method, self.threads_per_rank)
            self._ranks.append(spawn_rank(f"batchinfer-pp-rank{rank}", worker_main, args))
            self.processes.append(self._ranks[-1].process)
        wait_started(self._ranks, what="pipeline-parallel start")
        return init_method

    def dead_ranks(self) -> dict[int, str]:
        """Rank -> why, for every rank whose process is gone."""
        return {rank: f"exit code {p.exitcode}" for rank, p in enumerate(self.processes, start=1)
                if not p.is_alive()}

    def stop(self, timeout_s: float) -> None:
        """Join the ranks (they were told to exit), terminating any still alive after timeout_s."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                if timeout_s:
                    logger.warning("pipeline rank %s did not exit; terminating it", process.name)
                process.terminate()
                process.join(5)
