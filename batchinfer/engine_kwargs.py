"""The seam from the settings to the engine: the EngineConfig keyword arguments batchinfer passes (issue 30).

Settings.engine_kwargs() gives every one of them from the settings; the engine flags of `batchinfer run` and
`batchinfer worker` override some; workers/process.py builds EngineConfig(model=..., **kwargs). A TypedDict,
not dict[str, Any], so the checker matches each key and value to EngineConfig's parameter of that name.
"""

from __future__ import annotations

from typing import TypedDict

from batchinfer.engine.speculative_config import SpeculativeConfig


class EngineKwargs(TypedDict, total=False):
    """EngineConfig's keyword arguments (batchinfer.engine.config), but `model`; partial for overrides."""

    device: str
    dtype: str
    kv_cache_dtype: str
    float32_matmul_precision: str
    quantization: str | None
    adaptive_threads: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    block_size: int
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: str
    speculative_config: SpeculativeConfig | None  # parsed from the setting's JSON (Settings.engine_kwargs)
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    grammar_compile_workers: int
    grammar_compile_timeout_s: float
    compiled_grammar_cache_bytes: int
    num_kv_blocks: int | None
    enforce_eager: bool
    seed: int
