"""One pipeline stage: its ModelRunner over a layer range, the wire format of a micro-batch, and the loop a
non-driver rank runs.

Ranks: global rank r = stage * tp_size + tp_rank; rank 0 (stage 0, tp rank 0) is the engine process.
Each stage's tp_size ranks form a tensor-parallel group (its all-reduces stay inside the stage). Rank
(s, t) receives a micro-batch from (s - 1, t) (stage 0's peers: from rank 0), runs its layers and sends
the residual stream to (s + 1, t); the last stage's tp rank 0 sends the logits back to rank 0. Every
tensor-parallel rank of a stage holds the same (all-reduced) hidden states, so rank (s, t) needs only
its counterpart's copy.

Per micro-batch, one message sequence on each link: a header [cmd, words, rows, dtype] (int64), the
step layout (int32: [S, T, B], per entry (num_computed_tokens, num_new, num_blocks, logits_count), the
new token ids, the block tables) and, from stage 1 on, the hidden states [rows, hidden]. Headers and
layouts travel on a gloo group (on CPU: the default group), hidden states and logits on the default
group (NCCL on GPU).

The header says the rows and dtype of the hidden states that follow, and the receiver allocates exactly
that, then checks it against the layout and its own dtype. Why: gloo cannot deliver a message into a
smaller buffer, and it finds out on its I/O thread, where the only way out is std::terminate: a
receiver that sized the buffer from its own expectation died with SIGABRT and no word of why (a flake:
"op.preamble.length <= op.nbytes. 19712 vs 9856": twice the bytes of the 77 bfloat16 rows it expected).
Now a disagreement between two ranks is a RuntimeError naming both sides, in the receiver's log.

Waiting: a rank idle between steps waits for the next header without a deadline (the default group's
timeout is IDLE_TIMEOUT); everything inside a step waits at most STEP_TIMEOUT_S. A rank whose peer
dies gets a connection error from gloo at once and exits, so a death propagates along the links to
rank 0 within milliseconds; STEP_TIMEOUT_S bounds a peer that is alive but stuck.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.layers.context import set_context
from batchinfer.engine.models import get_model_class
from batchinfer.engine.models.loader import load_weights
from batchinfer.engine.models.pipeline_stage import PipelineStage
from batchinfer.engine.models.resolved_model import ResolvedModel
from batchinfer.engine.parallel import distributed
from batchinfer.engine.parallel.distributed import CMD_EXIT, CMD_STEP, StepSequence, _TokenWindow
from batchinfer.engine.worker.model_runner import ModelRunner, _default_dtype
from batchinfer.engine.worker.runner_protocol import EMBEDDINGS_NEED_ONE_STAGE, ScheduledSequence

if TYPE_CHECKING:  # the one architecture; imported for types only
    from batchinfer.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Inside a step no message takes longer than this unless a peer is stuck (well within a 120 s shard lease).
STEP_TIMEOUT_S = 60.0
# The default group's timeout: how long an idle rank waits for the next step.
IDLE_TIMEOUT = timedelta(days=30)
# How long the ranks have to meet at startup (the store's timeout: also NCCL's first communicator setup,
# which waits for the slowest rank's weights).
STARTUP_TIMEOUT = timedelta(minutes=10)
_LAYOUT_HEAD = 3  # S, T, B
HEADER_WORDS = 4  # cmd, layout words, hidden-state rows, hidden-state dtype (an index of WIRE_DTYPES)
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_META = 4  # per entry: num_computed_tokens, num_new, num_blocks, logits_count


@dataclass
class PipelineStats:
    """Rank 0's seconds per part of its steps, accumulated for bench/pp_comm.py (perf_counter pairs)."""

    steps: int = 0
    micro_batches: int = 0
    stage_s: float = 0.0  # stage 0's own forward over every micro-batch
    send_s: float = 0.0  # posting the sends of layouts and hidden states
    logits_wait_s: float = 0.0  # waiting for the last stage's logits: stage 0 idle, its share of the bubble


PIPE_STATS = PipelineStats()


@dataclass(frozen=True)
class Topology:
    """tp_size ranks per stage, pp_size stages; rank = stage * tp_size + tp_rank."""

    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.tp_size * self.pp_size

    def rank(self, stage: int, tp_rank: int) -> int:
        """The global rank of (stage, tp_rank)."""
        return stage * self.tp_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp_rank) of a global rank."""
        return divmod(rank, self.tp_size)

    def describe(self, rank: int) -> str:
        """'rank 3 (stage 1, tp rank 1)'."""
        stage, tp_rank = self.coords(rank)
        return f"rank {rank} (stage {stage}, tp rank {tp_rank})"


@dataclass
class PipelineGroups:
    """The process groups a rank talks on: control (headers, layouts; None = default group), its TP group."""

    control: dist.ProcessGroup | None
    tensor_parallel: dist.ProcessGroup | None


def init_pipeline(rank: int, topology: Topology, *, backend: str, init_method: str) -> PipelineGroups:
    """Join the world (blocks until every rank has joined, STARTUP_TIMEOUT at most) and make the groups;
    every rank calls this. init_method: tcp://host:port, where rank 0 serves the rendezvous store."""
    if dist.is_initialized():
        raise RuntimeError("a parallel engine is already running in this process; close() it first")
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    # The store bounds the rendezvous (a rank that dies before joining fails the start), while the group's
    # own timeout is the idle one.
    store = dist.TCPStore(host, int(port), topology.world_size, is_master=rank == 0, timeout=STARTUP_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=topology.world_size,
                            timeout=IDLE_TIMEOUT)
    control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    own = None
    if topology.tp_size > 1:
        step_timeout = timedelta(seconds=STEP_TIMEOUT_S)
        for stage in range(topology.pp_size):  # every rank creates every group, in the same order
            ranks = [topology.rank(stage, t) for t in range(topology.tp_size)]
            group = dist.new_group(ranks, timeout=step_timeout)
            if rank in ranks:
                own = group
        stage, tp_rank = topology.coords(rank)
        distributed.use_tensor_parallel_group(own, tp_rank, topology.tp_size, leader=topology.rank(stage, 0))
    return PipelineGroups(control, own)


def destroy_pipeline() -> None:
    """Leave every group; this process is a single rank again."""
    distributed.destroy_tensor_parallel()


def wait_for(work: dist.Work | None, what: str) -> None:
    """Wait for one send/recv of a step, at most STEP_TIMEOUT_S (a gloo timeout closes the link: fatal)."""
    if work is None:  # torch returns no Work to a rank outside the group: a wiring bug, never a peer's
        raise RankFailedError(f"{what}: this rank is not in the group it sent or received on")
    try:
        work.wait(timeout=timedelta(seconds=STEP_TIMEOUT_S))
    except RuntimeError as exc:
        raise RankFailedError(f"{what}: {exc}") from exc


# --- the wire format of a micro-batch ----------------------------------------------------------------


def encode_layout(scheduled: Sequence[tuple[ScheduledSequence, int]], counts: list[int]) -> torch.Tensor:
    """int32 [S, T, B, per-entry meta, new token ids, block tables] of a micro-batch."""
    meta: list[int] = []
    tokens: list[int] = []
    blocks: list[int] = []
    for (seq, num_new), count in zip(scheduled, counts, strict=True):
        begin = seq.num_computed_tokens
        meta += (begin, num_new, len(seq.block_table), count)
        tokens += seq.token_ids[begin : begin + num_new]
        blocks += seq.block_table
    words = [len(scheduled), len(tokens), len(blocks), *meta, *tokens, *blocks]
    return torch.tensor(words, dtype=torch.int32)


def decode_layout(layout: torch.Tensor) -> tuple[list[tuple[StepSequence, int]], list[int], int]:
    """(stand-in (sequence, num_new) entries, logits counts, new tokens in all) of an encoded layout."""
    words = layout.tolist()
    num_seqs, num_tokens, _ = words[:_LAYOUT_HEAD]
    meta_end = _LAYOUT_HEAD + _META * num_seqs
    token_at, block_at = meta_end, meta_end + num_tokens
    scheduled: list[tuple[StepSequence, int]] = []
    counts: list[int] = []
    for i in range(num_seqs):
        begin, num_new, num_blocks, count = words[_LAYOUT_HEAD + _META * i : _LAYOUT_HEAD + _META * (i + 1)]
        window = _TokenWindow(begin, words[token_at : token_at + num_new])
        scheduled.append((StepSequence(window, begin, words[block_at : block_at + num_blocks]), num_new))
        counts.append(count)
        token_at += num_new
        block_at += num_blocks
    return scheduled, counts, num_tokens


def header(cmd: int, words: int = 0, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The int64 [cmd, layout words, rows, dtype] that opens a micro-batch's messages; rows and dtype
    describe the hidden states sent after the layout (0, 0 when none follow)."""
    rows, dtype = (0, 0) if hidden is None else (hidden.shape[0], WIRE_DTYPES.index(hidden.dtype))
    return torch.tensor([cmd, words, rows, dtype], dtype=torch.int64)


def receive_hidden(head: list[int], num_tokens: int, runner: StageRunner, source: int) -> torch.Tensor:
    """The hidden states the header announces, checked against the layout and this stage's dtype."""
    _, _, rows, code = head
    dtype = WIRE_DTYPES[code]
    if rows != num_tokens or dtype != runner.dtype:
        raise RuntimeError(
            f"rank {source} sends hidden states of {rows} tokens in {dtype} for a micro-batch of "
            f"{num_tokens} tokens, but this stage runs {runner.dtype}: the ranks disagree on the model (a "
            "different dtype setting, or different code: was the source tree changed while they started?)")
    hidden = torch.empty(rows, runner.hf_config.hidden_size, dtype=dtype, device=runner.device)
    wait_for(dist.irecv(hidden, src=source), f"hidden states from rank {source}")
    return hidden


# --- a stage's model runner ------------------------------------------------------------------------


class StageRunner(ModelRunner):
    """A ModelRunner over one stage's layers: only their weights and their KV cache live on this rank."""

    def __init__(self, config: EngineConfig, model: ResolvedModel, stage: PipelineStage) -> None:
        """CUDA graphs capture whole-model forwards, so a stage runs eagerly."""
        self.stage = stage
        super().__init__(dataclasses.replace(config, enforce_eager=True), model, screen_greedy_rows=False)
        # Every stage must hold the same block ids: agree on the smallest count over the whole pipeline.
        agreed = _world_min(self.num_kv_blocks, self.device)
        if agreed != self.num_kv_blocks:
            for attn in self.attention_layers:  # the old cache freed before the agreed one is allocated
                attn.k_cache = attn.v_cache = torch.empty(0)
                attn.quantized_kv = None  # its codes and params views would keep the old cache alive
            self.kv_cache = None
            self.num_kv_blocks = agreed
            self.kv_cache = self._allocate_kv_cache(agreed)

    def _build_model(self) -> torch.nn.Module:
        """Only this stage's modules, and only their checkpoint tensors read."""
        model_cls = get_model_class(self.hf_config)
        with _default_dtype(self.dtype), torch.device(self.device):
            model = model_cls(self.hf_config, self.max_model_len, stage=self.stage)
        load_weights(model, self.model_path)
        return model.eval()

    @torch.inference_mode()
    def run_stage(
        self,
        scheduled: Sequence[tuple[ScheduledSequence, int]],
        counts: list[int] | None,
        hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        """This stage's layers over a micro-batch: the residual stream [T, hidden], or (last stage) logits."""
        batch = self._prepare(scheduled, counts)
        if hidden_states is None and not self.stage.is_first:  # the CUDA profiling forward: any input
            hidden_states = torch.zeros(len(batch.input_ids), self.hf_config.hidden_size, dtype=self.dtype,
                                        device=self.device)
        set_context(batch.context)
        try:
            out = self.model(batch.input_ids, batch.positions, hidden_states)
        finally:
            set_context(None)
        if not self.stage.is_last:
            return out
        model = cast("LlamaForCausalLM", self.model)
        logits = model.compute_logits(out.index_select(0, batch.logits_indices))
        return logits.float()

    def execute_model(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None,
        *, argmax_only_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """The stage alone (the CUDA profiling forward calls this).

        argmax_only_rows is ignored: full logits (ModelRunnerProtocol allows it).
        """
        counts = None if logits_counts is None else list(logits_counts)
        return self.run_stage(list(scheduled), counts, None)

    def embed(self, token_id_lists: Sequence[list[int]]) -> list[list[float]]:
        """Embeddings pool the final hidden state, which no single stage has."""
        raise ValueError(EMBEDDINGS_NEED_ONE_STAGE)


def _world_min(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


# --- a non-driver rank -----------------------------------------------------------------------------


def serve_stage(runner: StageRunner, topology: Topology, rank: int, groups: PipelineGroups) -> None:
    """Receive micro-batches, run this stage on them and pass the result on, until told to exit."""
    stage, tp_rank = topology.coords(rank)
    source = 0 if stage == 0 else topology.rank(stage - 1, tp_rank)
    target = topology.rank(stage + 1, tp_rank) if stage + 1 < topology.pp_size else None
    pending: list[tuple[dist.Work | None, torch.Tensor]] = []  # sends in flight, with the tensors they read
    while True:
        head = torch.empty(HEADER_WORDS, dtype=torch.int64)
        dist.recv(head, src=source, group=groups.control)  # idle between steps: no step deadline
        cmd, words = head.tolist()[:2]
        if cmd == CMD_EXIT:
            _finish(pending, "passing the last micro-batch on")
            if target is not None:
                dist.send(header(CMD_EXIT), dst=target, group=groups.control)
            return
        if cmd != CMD_STEP:
            raise RuntimeError(f"unknown pipeline command {cmd} from rank {source}")
        layout = torch.empty(words, dtype=torch.int32)
        wait_for(dist.irecv(layout, src=source, group=groups.control), f"layout from rank {source}")
        scheduled, counts, num_tokens = decode_layout(layout)
        hidden = receive_hidden(head.tolist(), num_tokens, runner, source) if stage > 0 else None
        out = runner.run_stage(scheduled, counts, hidden).contiguous()
        _finish(pending, "passing a micro-batch on")
        if target is not None:
            head = header(CMD_STEP, words, out)
            pending = [(dist.isend(head, dst=target, group=groups.control), head),
                       (dist.isend(layout, dst=target, group=groups.control), layout),
                       (dist.isend(out, dst=target), out)]
        elif tp_rank == 0:
            pending = [(dist.isend(out, dst=0), out)]


def _finish(pending: list[tuple[dist.Work | None, torch.Tensor]], what: str) -> None:
    for work, _ in pending:
        wait_for(work, what)
    pending.clear()


def worker_main(config: EngineConfig, model: ResolvedModel, rank: int, topology: Topology, backend: str,
                init_method: str, threads: int) -> None:
    """A non-driver rank's whole life: join, build its stage, serve steps, leave."""
    from batchinfer.engine.models.pipeline_stage import split_layers

    logging.basicConfig(level=logging.INFO, format=f"[pp rank {rank}] %(levelname)s %(name)s: %(message)s")
    if backend == "gloo":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(torch.device(config.resolved_device()))
    groups = init_pipeline(rank, topology, backend=backend, init_method=init_method)
    try:
        stage = split_layers(model.hf_config.num_hidden_layers, topology.pp_size, topology.coords(rank)[0])
        serve_stage(StageRunner(config, model, stage), topology, rank, groups)
    finally:
        destroy_pipeline()
