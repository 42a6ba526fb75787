"""vLLM's periodic engine log line: prompt and generation throughput, queues, KV usage, prefix-cache hits.

MetricsRecorder (metrics.py) folds each step's StepStats in; a line is logged once per interval, with the
throughputs and the prefix-cache hit rate over it, the queues and KV usage as of its last step.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol


class StepFigures(Protocol):
    """What the line reads of a step (metrics.StepStats has these; no import back, so no cycle)."""

    num_prompt_tokens: int
    num_generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float

logger = logging.getLogger("batchinfer.engine")


class StatLogger:
    """Logs vLLM's periodic line: throughput, running/waiting, KV usage, prefix-cache hit rate."""

    def __init__(self, interval_s: float = 5.0, log: logging.Logger = logger) -> None:
        self.interval_s = interval_s
        self.log = log
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._queries = 0
        self._hits = 0

    def record_step(self, stats: StepFigures, now: float | None = None) -> str | None:
        """Accumulate a step; return (and log) the line when the interval has passed."""
        now = time.monotonic() if now is None else now
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
        line = (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )
        self.log.info(line)
        self._reset(now)
        return line
