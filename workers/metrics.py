"""A worker's own metrics, and the HTTP port each `batchinfer worker` serves them on with its engine's.

The worker's figures sit beside the engine's under `batchinfer:worker_*`, with the same `model_name` and
`engine` labels, so a dashboard can join a worker's shard counters with its engine's token counters:
shards claimed / completed / released, lease losses, and how long a batch of results takes to write.

The exporter is prometheus_client's threaded HTTP server over the process registry, started once per
process and port (`worker_metrics_port`, or `batchinfer worker --metrics-port`; 0 or unset: off). It is
started after the engine is built: under tensor parallelism the rank processes exist by then and hold no
listening socket (spawned, not forked), and only rank 0 has an engine that records, so there is exactly
one exporter per engine.

`heartbeat_info()` is what the worker table carries for the dashboard: the metrics port and the tokens
generated per second over about the last RATE_WINDOW_S (sampled at claims, writes and heartbeats).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server

from batchinfer.engine.metrics import LABELS, PREFIX
from batchinfer.store.progress import InflightReport
from batchinfer.wire.heartbeat import HeartbeatInfo

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from batchinfer.engine.llm_engine import Engine

logger = logging.getLogger("batchinfer.workers")

WORKER_PREFIX = f"{PREFIX}worker_"
RATE_WINDOW_S = 10.0  # the current throughput is measured over about this long (a busy heartbeat's period)
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Families:
    """The worker metric families of one registry (created once: prometheus_client forbids duplicates)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{WORKER_PREFIX}{name}", doc, LABELS, registry=registry)

        self.claimed = counter("shards_claimed", "Shards this worker claimed (leased).")
        self.completed = counter("shards_completed", "Shards this worker ran to completion.")
        self.released = counter("shards_released", "Shards handed back (shutdown, job cancelled or expired).")
        self.lease_losses = counter("lease_losses", "Writes refused because the shard's lease was lost.")
        self.results_written = counter("results_written", "Finished requests written to the database.")
        # Result cache (workers/result_cache.py): lines served without the engine, by where from.
        self.cache_hits = Counter(f"{PREFIX}result_cache_hits", "Lines served from an earlier job's result.",
                                  LABELS, registry=registry)
        self.cache_dedups = Counter(f"{PREFIX}result_cache_dedup", "Lines copied from an identical line "
                                    "of their own job.", LABELS, registry=registry)
        self.write_seconds = Histogram(f"{WORKER_PREFIX}result_write_seconds",
                                       "Time to write one batch of results (one transaction).", LABELS,
                                       buckets=WRITE_BUCKETS, registry=registry)


_FAMILIES: dict[int, _Families] = {}
_servers: dict[int, WSGIServer] = {}  # port -> the exporter serving it in this process
_lock = threading.Lock()


def _families(registry: CollectorRegistry) -> _Families:
    with _lock:
        if id(registry) not in _FAMILIES:
            _FAMILIES[id(registry)] = _Families(registry)
        return _FAMILIES[id(registry)]


class WorkerMetrics:
    """One worker's counters, bound to its engine's labels; plus the throughput its heartbeat reports."""

    def __init__(self, *, model_name: str, engine: str, generated_tokens: Callable[[], int] | None = None,
                 steps: Callable[[], int] | None = None, registry: CollectorRegistry = REGISTRY) -> None:
        fam = _families(registry)
        self.labels = {"model_name": model_name, "engine": engine}
        values = (model_name, engine)
        self._claimed = fam.claimed.labels(*values)
        self._completed = fam.completed.labels(*values)
        self._released = fam.released.labels(*values)
        self._lease_losses = fam.lease_losses.labels(*values)
        self._results_written = fam.results_written.labels(*values)
        self._cache_served = {"hit": fam.cache_hits.labels(*values),
                              "dedup": fam.cache_dedups.labels(*values)}
        self._write_seconds = fam.write_seconds.labels(*values)
        self._generated_tokens = generated_tokens or (lambda: 0)  # () -> tokens generated so far
        # (monotonic time, tokens so far), taken at claims, writes and heartbeats: the last RATE_WINDOW_S.
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), self._generated_tokens())])
        self._generated_at: float | None = None  # wall clock of the last sample that saw new tokens
        self._steps = steps or (lambda: 0)  # () -> engine steps so far: a sequence's pace, one token a step
        self._step_samples: deque[tuple[float, int]] = deque([(time.monotonic(), self._steps())])
        self.metrics_port: int | None = None
        self.lora_adapters: list[str] = []  # the LoRA adapters this worker serves (served_models reads them)

    @classmethod
    def for_engine(cls, engine: Engine, registry: CollectorRegistry = REGISTRY) -> WorkerMetrics:
        """Metrics labelled like `engine`'s own, reading its generated-token total for the heartbeat."""
        labels = engine.recorder.metrics.labels
        return cls(model_name=labels["model_name"], engine=labels["engine"],
                   generated_tokens=lambda: engine.recorder.generation_tokens,
                   steps=lambda: engine.recorder.num_steps, registry=registry)

    def shard_claimed(self) -> None:
        """Count a shard this worker leased."""
        self._claimed.inc()
        self._sample()

    def shard_completed(self) -> None:
        """Count a shard run to completion."""
        self._completed.inc()

    def shard_released(self) -> None:
        """Count a shard handed back unfinished."""
        self._released.inc()

    def result_cache_served(self, source: str) -> None:
        """Count a line served without the engine: source "hit" (an earlier job's) or "dedup" (a twin's)."""
        counter = self._cache_served.get(source)
        if counter is not None:
            counter.inc()

    def lease_lost(self) -> None:
        """Count a write or completion refused because another worker (or the rescuer) took the lease."""
        self._lease_losses.inc()

    @contextmanager
    def timed_write(self, count: int) -> Iterator[None]:
        """Time one write of `count` results; they count as written only if the block does not raise."""
        start = time.perf_counter()
        yield
        self._write_seconds.observe(time.perf_counter() - start)
        self._results_written.inc(count)
        self._sample()

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens generated per second over about the last RATE_WINDOW_S: 0 once nothing was generated for
        that long (sparse idle samples would otherwise spread the last busy seconds over minutes)."""
        self._sample(now)
        (start, first), (end, last) = self._samples[0], self._samples[-1]
        if end <= start or last == first:
            return 0.0
        return max((last - first) / (end - start), 0.0)

    def steps_per_second(self, now: float | None = None) -> float:
        """Engine steps per second over about the last RATE_WINDOW_S: how fast one running sequence grows."""
        now = time.monotonic() if now is None else now
        self._step_samples.append((now, self._steps()))
        while len(self._step_samples) > 2 and now - self._step_samples[1][0] >= RATE_WINDOW_S:
            self._step_samples.popleft()
        (start, first), (end, last) = self._step_samples[0], self._step_samples[-1]
        return (last - first) / (end - start) if end > start else 0.0

    def heartbeat_info(self, now: float | None = None) -> HeartbeatInfo:
        """The worker table's `info`: labels, metrics port, the current tokens/s (an instantaneous figure,
        over RATE_WINDOW_S) and when it last generated (unix s; the dashboard shows 0 once that is old)."""
        rate = round(self.tokens_per_second(now), 1)
        info = HeartbeatInfo(model_name=self.labels["model_name"], engine=self.labels["engine"],
                             metrics_port=self.metrics_port, tokens_per_second=rate,
                             generated_at=self._generated_at)
        if self.lora_adapters:
            info["lora_adapters"] = self.lora_adapters
        return info

    def _sample(self, now: float | None = None) -> None:
        """Remember the token total now; keep one sample at or before the window's start, and none older
        than the last growth of the total (an idle stretch contributes no old tokens)."""
        now = time.monotonic() if now is None else now
        tokens = self._generated_tokens()
        if tokens != self._samples[-1][1]:
            self._generated_at = time.time()
        elif now - self._samples[-1][0] >= RATE_WINDOW_S:
            self._samples.clear()  # nothing generated for a whole window: the rate starts again from 0
        self._samples.append((now, tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()

    def serve(self, *, port: int | None, host: str = "0.0.0.0",
              registry: CollectorRegistry = REGISTRY) -> int | None:
        """Serve the process's metrics on `port` (0 or None: off); returns the port or None."""
        self.metrics_port = serve_metrics(port, host=host, registry=registry)
        return self.metrics_port


def inflight_report(engine: Engine, request_ids: Iterable[str], *, steps_per_second: float) -> InflightReport:
    """What the engine's generation requests among `request_ids` generated so far and may generate in all,
    and how long the longest needs at `steps_per_second` (a shard heartbeat's report, store.progress;
    embeddings are not in the engine and count nothing)."""
    requests = tokens = budget = longest = 0
    for request_id in request_ids:
        state = engine.request_progress(request_id)
        if state is not None:
            requests, tokens, budget = requests + 1, tokens + state[0], budget + state[1]
            longest = max(longest, state[1] - state[0])
    critical = longest / steps_per_second if steps_per_second > 0 else 0.0
    return InflightReport(requests=requests, tokens=tokens, budget=budget, critical_s=round(critical, 2))


def serve_metrics(port: int | None, *, host: str = "0.0.0.0",
                  registry: CollectorRegistry = REGISTRY) -> int | None:
    """Start the HTTP exporter on `port` once per process (a second call reuses it); None when off."""
    if not port:
        return None
    with _lock:
        if port not in _servers:
            try:
                server, _ = start_http_server(port, addr=host, registry=registry)
            except OSError as exc:
                message = (f"worker metrics: cannot listen on {host}:{port} ({exc.strerror}); pick a free "
                           "port with --metrics-port or worker_metrics_port")
                raise OSError(exc.errno, message) from exc
            _servers[port] = server
            logger.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)
        return port


def stop_metrics(port: int) -> None:
    """Stop this process's exporter on `port` (tests; a worker's exporter lives as long as it does)."""
    with _lock:
        server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()
