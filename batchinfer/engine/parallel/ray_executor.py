"""The Ray executor (distributed_executor_backend="ray"): ranks 1..N-1 of a parallel engine as Ray actors on
a running Ray cluster; the multiprocessing launcher (pp_runner.ProcessLauncher) stays the single-node
default.

Placement: stage 0's other tensor-parallel ranks run on this node (the engine process is its rank 0),
pinned by node affinity; each later stage's ranks get a placement group of tp_size bundles with
STRICT_PACK, so a tensor-parallel group never spans two nodes and only the stage-to-stage hidden states
cross the network. One bundle / actor per rank: {"CPU": 1} on CPU, {"GPU": 1} on CUDA (the actor's
device is then its one visible GPU, cuda:0).

Connecting: this process joins the cluster that is already running (`ray start --head` on one node,
`ray start --address=<head>:6379` on the others): an initialized Ray, else RAY_ADDRESS, else "auto".
The ranks meet over torch.distributed at this node's address. Every node must see the model at the same
path (a shared filesystem or the same local copy).

Liveness: each actor runs its rank in one long call (`run`), whose result is ready when the rank exits
or the actor dies; dead_ranks reports those, so a killed actor fails the step with its rank's name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from types import ModuleType
from typing import TYPE_CHECKING

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.models.resolved_model import ResolvedModel
from batchinfer.engine.parallel.pp_stage import Topology, worker_main

if TYPE_CHECKING:  # ray is an optional dependency
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # a cluster that cannot place a stage's bundles by then is too small


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            "distributed_executor_backend: 'ray' needs the ray package (pip install 'ray==2.60.0')"
        ) from exc
    return ray


class _RankActor:
    """One non-driver rank; `run` blocks for the rank's whole life."""

    def run(self, config: EngineConfig, model: ResolvedModel, rank: int, topology: Topology, backend: str,
            init_method: str) -> int:
        """Join the pipeline and serve it until told to exit; this process's pid."""
        worker_main(config, model, rank, topology, backend, init_method, threads=1)
        return os.getpid()


class RayLauncher:
    """Ranks 1..N-1 as Ray actors on the running cluster (see the module docstring for their placement)."""

    def __init__(self) -> None:
        self.actors: dict[int, ActorHandle[_RankActor]] = {}
        self.runs: dict[int, ObjectRef[int]] = {}  # rank -> its `run` call (the rank's pid when it exits)
        self.placement_groups: list[PlacementGroup] = []
        self.threads_per_rank = 1

    def start(self, config: EngineConfig, model: ResolvedModel, topology: Topology, backend: str) -> str:
        """Place and start the actors; the init_method they join (this node's address)."""
        ray = _ray()
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or "auto"
            try:
                ray.init(address=address, logging_level=logging.WARNING)
            except ConnectionError as exc:
                raise ValueError(
                    f"distributed_executor_backend: 'ray' found no running Ray cluster at {address!r}: start "
                    "one (`ray start --head`, then `ray start --address=<head>:6379` on each other node) or "
                    "set RAY_ADDRESS"
                ) from exc
        gpu = backend == "nccl"
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        actor_cls = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(_RankActor)
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{_free_port(host)}"
        # The actor's view of the device: one GPU (Ray sets CUDA_VISIBLE_DEVICES), or the CPU.
        rank_config = dataclasses.replace(config, device="cuda:0" if gpu else "cpu")
        here = ray.get_runtime_context().get_node_id()
        for stage in range(topology.pp_size):
            first = 1 if stage == 0 else 0  # stage 0's rank 0 is this process
            if stage == 0:
                strategy: NodeAffinitySchedulingStrategy | PlacementGroupSchedulingStrategy = (
                    NodeAffinitySchedulingStrategy(node_id=here, soft=False)
                )
            else:
                group = ray.util.placement_group([bundle] * topology.tp_size, strategy="STRICT_PACK")
                self.placement_groups.append(group)
                ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
                if not ready:
                    raise RuntimeError(
                        f"the Ray cluster cannot place stage {stage}'s {topology.tp_size} x {bundle} on one "
                        f"node within {PLACEMENT_TIMEOUT_S:g}s; add nodes or lower tensor_parallel_size"
                    )
            for tp_rank in range(first, topology.tp_size):
                rank = topology.rank(stage, tp_rank)
                if stage > 0:
                    strategy = PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=tp_rank
                    )
                actor = actor_cls.options(scheduling_strategy=strategy).remote()
                self.actors[rank] = actor
                self.runs[rank] = actor.run.remote(rank_config, model, rank, topology, backend, init_method)
        return init_method

    def dead_ranks(self) -> dict[int, str]:
        """Rank -> why, for every rank whose actor has exited or died."""
        ray = _ray()
        refs = list(self.runs.values())
        if not refs:
            return {}
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        dead = {}
        for rank, ref in self.runs.items():
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                    dead[rank] = "its Ray actor exited"
                except Exception as exc:  # RayActorError, a rank's own exception
                    dead[rank] = f"its Ray actor died: {type(exc).__name__}"
        return dead

    def stop(self, timeout_s: float) -> None:
        """Wait for the ranks to exit (they were told to), then kill the actors and free their bundles."""
        ray = _ray()
        if self.runs and timeout_s:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors.values():
            ray.kill(actor)
        for group in self.placement_groups:
            ray.util.remove_placement_group(group)
        self.actors.clear()
        self.runs.clear()
        self.placement_groups.clear()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
