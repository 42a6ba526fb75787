"""vLLM's `lora_requests_info` gauge under `batchinfer:`, with the engine's two labels.

  lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}   the time of the last update

As vLLM's: the adapters of the running and of the waiting requests, comma-separated names, in labels; the
value is the unix time it was last set. A changed set of adapters replaces the series (no stale series
stays behind). Folded at most once per FOLD_INTERVAL_S: the waiting names cost a pass over the queue.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from batchinfer.engine.metrics import LABELS, PREFIX

if TYPE_CHECKING:
    from batchinfer.engine.core.scheduler import Scheduler

FOLD_INTERVAL_S = 1.0
_FAMILIES: dict[int, Gauge] = {}
_lock = threading.Lock()


def _family(registry: CollectorRegistry) -> Gauge:
    with _lock:
        if id(registry) not in _FAMILIES:
            _FAMILIES[id(registry)] = Gauge(
                f"{PREFIX}lora_requests_info", "Running and waiting LoRA adapters (value: last update time).",
                [*LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=registry)
        return _FAMILIES[id(registry)]


class LoRAMetrics:
    """One engine's lora_requests_info series, refreshed from its scheduler by fold()."""

    def __init__(self, labels: dict[str, str], max_loras: int,
                 registry: CollectorRegistry = REGISTRY) -> None:
        self._gauge = _family(registry)
        self._values = (labels["model_name"], labels["engine"], str(max_loras))
        self._series: tuple[str, ...] | None = None
        self._folded_at = 0.0

    def fold(self, scheduler: Scheduler, now: float | None = None) -> None:
        """Publish the adapters of the running and waiting sequences (at most once per FOLD_INTERVAL_S)."""
        now = time.monotonic() if now is None else now
        if now - self._folded_at < FOLD_INTERVAL_S:
            return
        self._folded_at = now
        running, waiting = scheduler.lora_names()
        series = (*self._values, ",".join(running), ",".join(waiting))
        if series != self._series:
            if self._series is not None:
                self._gauge.remove(*self._series)
            self._series = series
        self._gauge.labels(*series).set(time.time())
