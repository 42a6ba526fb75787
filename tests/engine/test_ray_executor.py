"""The Ray executor on a local two-node Ray cluster (ray.cluster_utils, both nodes on this machine).

The head node (where this test process, the engine's rank 0, runs) offers 1 CPU and the second node 2:
a stage's two tensor-parallel ranks need 2 CPUs on one node (STRICT_PACK), so stage 1 can only land on
the second node, while stage 0's other rank is pinned beside rank 0 on the head. Skipped without ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.errors import RankFailedError
from tests.engine.test_tensor_parallel import GREEDY, generate, shared_prefix_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration  # a Ray cluster: several processes


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[Any]:
    """A head node with 1 CPU and a second node with 2, this process connected as the driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield second
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_tp2_x_pp2_equals_one_rank_and_packs_each_tp_group(tiny_llama, two_node_cluster) -> None:
    prompts = shared_prefix_prompts(8)
    expected, _ = generate(tiny_llama, prompts, GREEDY)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", pipeline_parallel_size=2,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        launcher = llm.engine.model_runner.launcher
        (stage1,) = launcher.placement_groups
        nodes = set(ray.util.placement_group_table(stage1)["bundles_to_node_id"].values())
        assert nodes == {two_node_cluster.node_id}  # both ranks of stage 1 on the second node
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.close()
    assert got == expected
    assert not launcher.actors and not launcher.placement_groups
    assert not torch.distributed.is_initialized()


def test_ray_tp2_alone_runs_as_one_stage(tiny_qwen2, two_node_cluster) -> None:
    """No pipeline: the Ray executor's actor is rank 1 of one tensor-parallel stage, beside rank 0."""
    prompts = shared_prefix_prompts(4)
    expected, _ = generate(tiny_qwen2, prompts, GREEDY)
    got, llm = generate(tiny_qwen2, prompts, GREEDY, tensor_parallel_size=2,
                        distributed_executor_backend="ray")
    assert got == expected
    assert not llm.engine.model_runner.launcher.actors


def test_killed_ray_actor_fails_the_step_naming_its_rank(tiny_llama, two_node_cluster) -> None:
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", pipeline_parallel_size=2,
              distributed_executor_backend="ray")
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for i, prompt in enumerate(shared_prefix_prompts(4)):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            engine.step()
        ray.kill(engine.model_runner.launcher.actors[1])
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(stage 1, tp rank 0\) \(its Ray actor died"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 15
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()
