"""One engine per worker process, and the loops that drive ShardRunner without a broker.

The engine is built lazily on first use, inside the process that runs it: a Celery worker forks (or not,
with the solo pool) before any task runs, so CUDA is never initialized before a fork.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Unpack, cast

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from batchinfer.config import Settings, get_settings
from batchinfer.engine_kwargs import EngineKwargs
from batchinfer.store import shards as shard_store
from batchinfer.store import workers as worker_store
from batchinfer.store.db import ping, session_factory
from workers.metrics import WorkerMetrics
from workers.runner import ProgressCallback, RunStats, ShardRunner

if TYPE_CHECKING:
    from batchinfer.engine.llm_engine import Engine

logger = logging.getLogger("batchinfer.workers")

_lock = threading.Lock()
_process_runner: ShardRunner | None = None
# The model this process serves; `batchinfer worker --model` sets it before the Celery worker starts.
process_model: str | None = None
process_engine_overrides: EngineKwargs = {}
process_settings: Settings | None = None  # `batchinfer worker`'s settings (LoRA flags); None: get_settings()
# The port this process serves its metrics on (`batchinfer worker --metrics-port`); None: off.
process_metrics_port: int | None = None
# Set when the worker begins a warm shutdown (SIGTERM): runners stop claiming and hand shards back.
shutdown_requested = threading.Event()


def worker_id_for(model: str) -> str:
    """A worker id unique to this process: host, pid and model."""
    return f"{socket.gethostname()}:{os.getpid()}:{model}"


def build_engine(model: str, settings: Settings, **overrides: Unpack[EngineKwargs]) -> Engine:
    """Load the engine for `model` with the settings' engine knobs (overrides win)."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.llm_engine import Engine

    kwargs: EngineKwargs = {**settings.engine_kwargs(), **overrides}
    return Engine(EngineConfig(model=model, **kwargs))


def make_runner(*, model: str, settings: Settings | None = None, engine: Engine | None = None,
                metrics_port: int | None = None, lazy: bool = False,
                **engine_overrides: Unpack[EngineKwargs]) -> ShardRunner:
    """A ShardRunner over a new (or the given) engine, registered in the worker table.

    `lazy`: the engine is built on the first request the result cache cannot serve (workers.lazy_engine;
    `batchinfer run`), so a job served wholly from the cache loads no model.

    With `metrics_port` the process serves its Prometheus metrics there (workers.metrics), started after
    the engine is built so tensor-parallel rank processes never hold the port.
    """
    settings = settings or get_settings()
    if engine is None and lazy:
        from batchinfer.engine.config import EngineConfig
        from workers.lazy_engine import LazyEngine

        kwargs: EngineKwargs = {**settings.engine_kwargs(), **engine_overrides}
        config = EngineConfig(model=model, **kwargs)
        lazy_engine = LazyEngine(lambda: build_engine(model, settings, **engine_overrides), config)
        metrics = lazy_engine.worker_metrics()
        engine = cast("Engine", lazy_engine)  # stands in for the Engine it builds on first use
    else:
        engine = engine if engine is not None else build_engine(model, settings, **engine_overrides)
        metrics = WorkerMetrics.for_engine(engine)
    metrics.lora_adapters = sorted(settings.lora_modules)  # advertised like models (store.workers)
    metrics.serve(port=metrics_port, host=settings.worker_metrics_host)
    sessions = session_factory(settings.effective_database_url)
    worker_id = worker_id_for(model)
    with sessions() as session:
        worker_store.register_worker(session, worker_id=worker_id, model=model, hostname=socket.gethostname(),
                                     pid=os.getpid(), info=metrics.heartbeat_info())
    return ShardRunner(engine=engine, sessions=sessions, model=model, worker_id=worker_id, settings=settings,
                       metrics=metrics)


def process_worker() -> ShardRunner:
    """This process's runner (engine loaded on first call, then reused by every task)."""
    global _process_runner
    with _lock:
        if _process_runner is None:
            settings = process_settings or get_settings()
            model = process_model or settings.default_model
            _process_runner = make_runner(model=model, settings=settings, metrics_port=process_metrics_port,
                                          **process_engine_overrides)
        return _process_runner


def heartbeat_process_worker() -> None:
    """Mark this process's worker live in the worker table (the presence duty; no-op before it exists)."""
    runner = _process_runner
    if runner is not None:
        with runner.sessions() as session:
            worker_store.worker_heartbeat(session, worker_id=runner.worker_id,
                                          info=runner.metrics.heartbeat_info())


def run_process_shard(shard_id: int) -> RunStats:
    """Claim `shard_id` (a no-op if it is taken), then keep this process's engine busy until no shard is left.

    What the Celery task run_shard does; `shutdown_requested` (a warm shutdown) hands held shards back.
    """
    return work_through_outages(process_worker(), first_shard_id=shard_id, stop=shutdown_requested)


def is_database_outage(exc: BaseException) -> bool:
    """True for errors that mean the database is (briefly) unreachable, not that a statement is wrong."""
    return isinstance(exc, OperationalError | InterfaceError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated)


def wait_and_hand_back(runner: ShardRunner, exc: BaseException, *, stop: threading.Event | None = None,
                       max_delay_s: float = 5.0) -> None:
    """After a database outage broke the runner's loop: wait for the database, then hand its shards back.

    Until the database answers the shards keep their leases (nobody else can take them either); once it
    does, finished results are written and the shards released, so they run again at once (pending
    requests only) instead of waiting for their leases to expire.
    """
    logger.warning("database unreachable or refusing writes (%s); handing shards back once it takes writes",
                   exc)
    delay = 0.5
    while stop is None or not stop.is_set():
        try:
            with runner.sessions() as session:
                ping(session)
            stats = runner.hand_back()
            # A database that reads but cannot write (a full disk) is still away: probe with the registry's
            # own write, or an idle worker (nothing to hand back) retries its failed write at once, forever.
            with runner.sessions() as session:
                worker_store.worker_heartbeat(session, worker_id=runner.worker_id,
                                              info=runner.metrics.heartbeat_info())
        except DBAPIError as again:
            if not is_database_outage(again):
                raise
            if stop is None:
                time.sleep(delay)
            else:
                stop.wait(delay)
            delay = min(max_delay_s, delay * 2)  # capped exponential backoff
            continue
        logger.info("database back: handed %d shard(s) back", stats.shards_released)
        return


def work_through_outages(runner: ShardRunner, *, first_shard_id: int | None = None, job_id: int | None = None,
                         stop: threading.Event | None = None,
                         on_progress: ProgressCallback | None = None) -> RunStats:
    """runner.work(...), resumed after a database outage (restart, failover) instead of failing."""
    while True:
        try:
            return runner.work(first_shard_id=first_shard_id, job_id=job_id, stop=stop,
                               on_progress=on_progress)
        except DBAPIError as exc:
            if not is_database_outage(exc):
                raise
            wait_and_hand_back(runner, exc, stop=stop)
            first_shard_id = None  # claimed again (or by others) from the database


def rescue_once(settings: Settings | None = None) -> shard_store.RescueReport:
    """One rescue pass: expired leases back to the queue (or failed after max_attempts)."""
    settings = settings or get_settings()
    with session_factory(settings.effective_database_url)() as session:
        return shard_store.rescue_expired(session)


def run_job(*, job_id: int, runner: ShardRunner, on_progress: ProgressCallback | None = None,
            stop: threading.Event | None = None) -> RunStats:
    """Work through one job's shards in this process (the local mode of `batchinfer run`)."""
    return runner.work(job_id=job_id, on_progress=on_progress, stop=stop)


def retire_runner(runner: ShardRunner) -> None:
    """Record the runner's worker as stopped (`batchinfer run` once its job is done): `workers` and the
    dashboard stop listing it at once, not a heartbeat's lifetime later."""
    with runner.sessions() as session:
        worker_store.deregister_worker(session, worker_id=runner.worker_id)


def poll_forever(runner: ShardRunner, *, stop: threading.Event, max_backoff_s: float = 5.0) -> None:
    """The broker-less worker: claim available shards from the database, backing off while idle.

    Rescue and expiry run beside it on the duty thread `batchinfer worker` starts (workers.duties).
    """
    backoff = 0.2
    while not stop.is_set():
        try:
            stats = work_through_outages(runner, stop=stop)
            if stats.shards_completed or stats.shards_released:
                backoff = 0.2
                continue
            with runner.sessions() as session:  # idle: the reported throughput falls to 0
                worker_store.worker_heartbeat(session, worker_id=runner.worker_id,
                                              info=runner.metrics.heartbeat_info())
        except DBAPIError as exc:  # the database is away while idle: wait, as the runner does
            if not is_database_outage(exc):
                raise
            wait_and_hand_back(runner, exc, stop=stop)
            continue
        stop.wait(backoff)
        backoff = min(max_backoff_s, backoff * 2)
    with runner.sessions() as session:
        worker_store.deregister_worker(session, worker_id=runner.worker_id)
