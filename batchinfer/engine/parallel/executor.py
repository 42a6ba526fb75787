"""Which model runner an engine gets: one rank, tensor-parallel ranks on this machine, or a pipeline.

- tensor_parallel_size = pipeline_parallel_size = 1 (any backend): ModelRunner (this process);
- tensor_parallel_size > 1 only, backend "mp": TensorParallelRunner (local processes, shared-memory
  step channel);
- pipeline_parallel_size > 1, or backend "ray": PipelineParallelRunner (stages over torch.distributed
  point-to-point messages; the ranks are local processes, or Ray actors on a running Ray cluster).
"""

from __future__ import annotations

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.models.resolved_model import ResolvedModel
from batchinfer.engine.worker.runner_protocol import ModelRunnerProtocol


def make_model_runner(config: EngineConfig, model: ResolvedModel) -> ModelRunnerProtocol:
    """The runner for config's parallel sizes and executor backend, over the already resolved model."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if config.pipeline_parallel_size > 1 or (ranks > 1 and config.distributed_executor_backend == "ray"):
        from batchinfer.engine.parallel.pp_runner import PipelineParallelRunner

        return PipelineParallelRunner(config, model)
    if config.tensor_parallel_size > 1:
        from batchinfer.engine.parallel.tp_runner import TensorParallelRunner

        return TensorParallelRunner(config, model)
    from batchinfer.engine.worker.model_runner import ModelRunner

    return ModelRunner(config, model)
