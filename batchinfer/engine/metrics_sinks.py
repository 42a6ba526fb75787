"""The shapes of the optional metric sinks the engine's StatsRecorder folds into each step.

Their classes (spec_decode.metrics, lora.metrics) import engine.metrics, so it names them by these Protocols.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchinfer.engine.core.scheduler import Scheduler
    from batchinfer.engine.spec_decode.speculator import SpecDecodeCounts


class SpecMetricsSink(Protocol):
    """spec_decode.metrics.SpecDecodeMetrics as the recorder uses it."""

    def fold(self, counts: SpecDecodeCounts) -> None:
        """Add the counts' growth since the last fold to the Prometheus counters."""


class LoRAMetricsSink(Protocol):
    """lora.metrics.LoRAMetrics as the recorder uses it."""

    def fold(self, scheduler: Scheduler) -> None:
        """Sample the scheduler's adapter state into the gauges."""
