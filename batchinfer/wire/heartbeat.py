"""What a worker reports in its heartbeat: the worker table's `info` (issue 30).

workers/metrics.py builds it (WorkerMetrics.heartbeat_info); store/workers.py stores it and hands it to its
readers: the dashboard's workers view, `batchinfer workers`, served_models (adapters count as models) and
the estimate's idle check. Every key is optional: a row written by an older worker may lack some.
"""

from __future__ import annotations

from typing import TypedDict


class HeartbeatInfo(TypedDict, total=False):
    """A worker's labels, metrics port, current throughput and LoRA adapters."""

    model_name: str  # the metrics' model label
    engine: str  # the metrics' engine label
    metrics_port: int | None
    tokens_per_second: float  # over about the last rate window
    generated_at: float | None  # unix seconds of the last sample that saw new tokens
    lora_adapters: list[str]  # served like models
