"""The engine's figures: EngineStats for get_stats(), and Prometheus metrics with vLLM's names under the
prefix `batchinfer:`, folded in once per step by MetricsRecorder.

Every series carries vLLM's two labels: `model_name` (a model's NAME: an alias or hub id as given, a
local directory or .gguf file by its last path part, never the path) and `engine` (the engine's index
among this process's engines of that model, "0" for a worker's one engine). Labelled children are bound
once per engine in `EngineMetrics.__init__`, so a step costs a handful of `inc`/`set`/`observe` calls and
no label lookups; `stat_logger.StatLogger` prints vLLM's periodic throughput line. Under tensor
parallelism only the engine (rank 0) records: the other ranks run the model and have no scheduler, so one
exporter per engine sees everything.
"""

from __future__ import annotations

import itertools
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from batchinfer.engine.stat_logger import StatLogger

if TYPE_CHECKING:
    from batchinfer.engine.core.block_manager import BlockManager
    from batchinfer.engine.core.scheduler import Scheduler
    from batchinfer.engine.metrics_sinks import LoRAMetricsSink, SpecMetricsSink
    from batchinfer.engine.outputs import RequestOutput
    from batchinfer.engine.spec_decode.speculator import SpecDecodeCounts

PREFIX = "batchinfer:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Tokens of one request's prompt or completion: vLLM's 1-2-5 series, up to the longest contexts.
REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
FINISHED_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")


@dataclass
class EngineStats:
    """Figures for metrics: queue sizes, KV usage, prefix cache and token counters (totals since start)."""

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens (vLLM semantics)
    prefix_cache_hits: int  # tokens
    prefix_cache_block_queries: int
    prefix_cache_block_hits: int
    num_preemptions: int
    prompt_tokens: int  # prompt tokens computed (a preempted request's recompute counts again)
    generation_tokens: int  # tokens sampled
    step_prompt_tokens: int  # the same two figures for the last step only
    step_generation_tokens: int
    num_steps: int
    # Speculative decoding (vLLM's spec_decode_* counters); all 0 without speculative_config.
    spec_num_drafts: int = 0  # verifications of a sequence's proposal
    spec_num_draft_tokens: int = 0  # tokens proposed
    spec_num_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # accepted at draft position i


@dataclass(slots=True)
class StepStats:
    """What one engine step did; counters are deltas for this step, gauges are the state after it."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_prompt_tokens: int = 0  # prompt tokens computed this step (cached ones excluded)
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the cache
    num_preemptions: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass(slots=True)
class FinishedRequestStats:
    """Timings of one finished request, in seconds since the epoch (time.time())."""

    finished_reason: str
    arrival_time: float
    first_scheduled_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    first_token_time: float | None = None


def model_label(model: str) -> str:
    """The `model_name` label of a model: an alias or hub id as given, a local path by its last part.

    Labels must not leak file paths (a home directory, a mount layout) into dashboards, and the same model
    must read the same on every host whatever directory it was loaded from.
    """
    path = Path(model).expanduser()
    if path.is_absolute() or model.startswith(("./", "../", "~")) or path.exists():
        return path.name.removesuffix(".gguf") or model
    return model


class _Families:
    """The metric families of one registry (created once: prometheus_client forbids duplicates)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"{PREFIX}{name}", doc, [*LABELS, *extra], registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, [*LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"{PREFIX}{name}", doc, LABELS, buckets=buckets, registry=registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage, 1 = full.")
        self.cache_config = gauge("cache_config_info", "The KV cache's configuration (value 1).",
                                  ("block_size", "num_gpu_blocks", "enable_prefix_caching"))
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests by reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = histogram("request_decode_time_seconds", "First token to finish.")
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens of a finished request.", REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of a finished request.",
                                                   REQUEST_TOKEN_BUCKETS)
        self.cpu_threads = gauge("cpu_threads", "Threads the engine's CPU work runs on now (threads.py).")
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          TOKEN_BUCKETS)


_FAMILIES: dict[int, _Families] = {}
_ENGINE_COUNTS: dict[tuple[int, str], itertools.count] = {}
_lock = threading.Lock()


def _families(registry: CollectorRegistry) -> _Families:
    with _lock:
        key = id(registry)
        if key not in _FAMILIES:
            _FAMILIES[key] = _Families(registry)
        return _FAMILIES[key]


def next_engine_label(model_name: str, registry: CollectorRegistry = REGISTRY) -> str:
    """The `engine` label of a new engine of `model_name` in this process: "0", then "1", ..."""
    with _lock:
        counter = _ENGINE_COUNTS.setdefault((id(registry), model_name), itertools.count())
        return str(next(counter))


class EngineMetrics:
    """The engine's metrics for one engine of one model, bound to their label values once."""

    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY, *,
                 engine: str | None = None) -> None:
        fam = _families(registry)
        self.model_name = model_label(model_name)
        self.engine = engine if engine is not None else next_engine_label(self.model_name, registry)
        self.labels = {"model_name": self.model_name, "engine": self.engine}
        values = (self.model_name, self.engine)
        self._families = fam
        self._running = fam.running.labels(*values)
        self._waiting = fam.waiting.labels(*values)
        self._kv_usage = fam.kv_usage.labels(*values)
        self._prefix_queries = fam.prefix_queries.labels(*values)
        self._prefix_hits = fam.prefix_hits.labels(*values)
        self._preemptions = fam.preemptions.labels(*values)
        self._prompt_tokens = fam.prompt_tokens.labels(*values)
        self._generation_tokens = fam.generation_tokens.labels(*values)
        self._success = {
            reason: fam.request_success.labels(*values, reason) for reason in FINISHED_REASONS
        }
        self._ttft = fam.ttft.labels(*values)
        self._itl = fam.itl.labels(*values)
        self._e2e = fam.e2e.labels(*values)
        self._queue = fam.queue.labels(*values)
        self._prefill = fam.prefill.labels(*values)
        self._decode = fam.decode.labels(*values)
        self._request_prompt_tokens = fam.request_prompt_tokens.labels(*values)
        self._request_generation_tokens = fam.request_generation_tokens.labels(*values)
        self._iteration_tokens = fam.iteration_tokens.labels(*values)

    def record_cache_config(self, *, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        """Publish the KV cache's configuration as vLLM's cache_config_info (one series, value 1)."""
        self._families.cache_config.labels(self.model_name, self.engine, str(block_size), str(num_blocks),
                                           str(enable_prefix_caching)).set(1)

    def record_cpu_threads(self, threads: int) -> None:
        """The thread count a CPU engine runs on now (the series exists for CPU engines only)."""
        self._families.cpu_threads.labels(self.model_name, self.engine).set(threads)

    def record_step(self, stats: StepStats) -> None:
        """Fold one step's figures into the metrics."""
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv_usage.set(stats.kv_cache_usage)
        if stats.prefix_cache_queries:
            self._prefix_queries.inc(stats.prefix_cache_queries)
            self._prefix_hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self._prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self._generation_tokens.inc(stats.num_generation_tokens)
        self._iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        if stats.time_to_first_tokens:
            observe_many(self._ttft, stats.time_to_first_tokens)
        if stats.inter_token_latencies:  # one per running sequence in every decode step
            observe_many(self._itl, stats.inter_token_latencies)

    def record_finished(self, request: FinishedRequestStats) -> None:
        """Count one finished request and observe its latencies and sizes."""
        counter = self._success.get(request.finished_reason)
        if counter is not None:
            counter.inc()
        self._e2e.observe(max(0.0, request.finished_time - request.arrival_time))
        self._request_prompt_tokens.observe(request.num_prompt_tokens)
        self._request_generation_tokens.observe(request.num_generation_tokens)
        scheduled, first_token = request.first_scheduled_time, request.first_token_time
        if scheduled is not None:
            self._queue.observe(max(0.0, scheduled - request.arrival_time))
            if first_token is not None:
                self._prefill.observe(max(0.0, first_token - scheduled))
        if first_token is not None:
            self._decode.observe(max(0.0, request.finished_time - first_token))


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """histogram.observe(v) for every v, in one pass: bucket indices by bisect, one increment per bucket.

    A decode step brings one inter-token latency per running sequence; observing them one by one costs a
    lock and a linear bucket scan each (~0.2 ms per step at 256 sequences). This reaches into
    prometheus_client's Histogram child (_upper_bounds, _buckets: per-bucket, non-cumulative counts; _sum)
    and falls back to observe() where those are missing. Same result as observe(): a value lands in the
    first bucket whose upper bound is >= the value.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 4:
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for index in map(bisect_left, itertools.repeat(bounds), values):
        counts[index] = counts.get(index, 0) + 1
    total.inc(sum(values))
    for index, count in counts.items():
        buckets[index].inc(count)


class MetricsRecorder:
    """An engine's token counters (for get_stats) and their fold into EngineMetrics and the StatLogger.

    The engine counts each step's tokens with count_tokens and calls record_step once per step and
    record_finished once per finished request; prefix-cache and preemption counters are read from the
    block manager and the scheduler, and only their growth since the last step is folded in.
    """

    def __init__(self, model_name: str, scheduler: Scheduler, block_manager: BlockManager, *,
                 engine: str | None = None) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.metrics = EngineMetrics(model_name, engine=engine)
        self.metrics.record_cache_config(block_size=block_manager.block_size,
                                         num_blocks=block_manager.num_total_blocks,
                                         enable_prefix_caching=block_manager.enable_prefix_caching)
        self.stat_logger = StatLogger()
        # Under speculative decoding: the engine's SpecDecodeCounts and their SpecDecodeMetrics.
        self.spec_counts: SpecDecodeCounts | None = None
        self.spec_metrics: SpecMetricsSink | None = None
        self.lora_metrics: LoRAMetricsSink | None = None  # the LoRAMetrics of an engine with enable_lora
        self.prompt_tokens = self.generation_tokens = self.num_steps = 0
        self.step_prompt_tokens = self.step_generation_tokens = 0
        self._reported = (0, 0, 0)  # prefix queries, hits, preemptions already folded into the metrics

    def count_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """This step's computed prompt tokens and sampled tokens; the totals grow by as much."""
        self.step_prompt_tokens, self.step_generation_tokens = prompt_tokens, generation_tokens
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def record_step(self, time_to_first_tokens: list[float], inter_token_latencies: list[float]) -> None:
        """Fold this step into the Prometheus metrics and the periodic log line (a few O(1) updates)."""
        cache, scheduler = self.block_manager.stats, self.scheduler
        queries, hits, preemptions = cache.queries, cache.hits, scheduler.num_preemptions
        seen_queries, seen_hits, seen_preemptions = self._reported
        self._reported = (queries, hits, preemptions)
        stats = StepStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            num_prompt_tokens=self.step_prompt_tokens,
            num_generation_tokens=self.step_generation_tokens,
            prefix_cache_queries=queries - seen_queries,
            prefix_cache_hits=hits - seen_hits,
            num_preemptions=preemptions - seen_preemptions,
            time_to_first_tokens=time_to_first_tokens,
            inter_token_latencies=inter_token_latencies,
        )
        self.metrics.record_step(stats)
        self.stat_logger.record_step(stats)
        if self.spec_metrics is not None and self.spec_counts is not None:
            self.spec_metrics.fold(self.spec_counts)
        if self.lora_metrics is not None:
            self.lora_metrics.fold(scheduler)

    def record_finished(self, output: RequestOutput) -> None:
        """Count a finished (or aborted) request and observe its latencies."""
        self.metrics.record_finished(FinishedRequestStats(
            finished_reason=output.outputs[0].finish_reason or "stop",
            arrival_time=output.metrics.arrival_time,
            first_scheduled_time=output.metrics.first_scheduled_time,
            finished_time=output.metrics.finished_time or time.time(),
            num_prompt_tokens=len(output.prompt_token_ids),
            num_generation_tokens=sum(len(c.token_ids) for c in output.outputs),
            first_token_time=output.metrics.first_token_time,
        ))

    def engine_stats(self) -> EngineStats:
        """The figures as of now."""
        bm, cache = self.block_manager, self.block_manager.stats
        stats = EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_used_blocks=bm.num_used_blocks,
            num_total_blocks=bm.num_total_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            prefix_cache_block_queries=cache.block_queries,
            prefix_cache_block_hits=cache.block_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            step_prompt_tokens=self.step_prompt_tokens,
            step_generation_tokens=self.step_generation_tokens,
            num_steps=self.num_steps,
        )
        if self.spec_counts is not None:  # else the spec_* fields keep their defaults (0, [])
            stats = replace(stats, **self.spec_counts.as_stats())
        return stats
