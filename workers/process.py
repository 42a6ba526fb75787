"""One engine per worker process, and the loops that drive ShardRunner without a broker.

The engine is built lazily on first use, inside the process that runs it: a Celery worker forks (or not,
with the solo pool) before any task runs, so CUDA is never initialized before a fork.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from batchinfer.config import Settings, get_settings
from batchinfer.store import shards as shard_store
from batchinfer.store import workers as worker_store
from batchinfer.store.db import session_factory
from workers.runner import ProgressCallback, RunStats, ShardRunner

if TYPE_CHECKING:
    from batchinfer.engine.llm_engine import Engine

logger = logging.getLogger("batchinfer.workers")

_lock = threading.Lock()
_process_runner: ShardRunner | None = None
# The model this process serves; `batchinfer worker --model` sets it before the Celery worker starts.
process_model: str | None = None
process_engine_overrides: dict[str, Any] = {}
# Set when the worker begins a warm shutdown (SIGTERM): runners stop claiming and hand shards back.
shutdown_requested = threading.Event()


def worker_id_for(model: str) -> str:
    """A worker id unique to this process: host, pid and model."""
    return f"{socket.gethostname()}:{os.getpid()}:{model}"


def build_engine(model: str, settings: Settings, **overrides: Any) -> Engine:
    """Load the engine for `model` with the settings' engine knobs (overrides win)."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.llm_engine import Engine

    kwargs = {**settings.engine_kwargs(), **overrides}
    return Engine(EngineConfig(model=model, **kwargs))


def make_runner(*, model: str, settings: Settings | None = None, engine: Engine | None = None,
                **engine_overrides: Any) -> ShardRunner:
    """A ShardRunner over a new (or the given) engine, registered in the worker table."""
    settings = settings or get_settings()
    engine = engine if engine is not None else build_engine(model, settings, **engine_overrides)
    sessions = session_factory(settings.effective_database_url)
    worker_id = worker_id_for(model)
    with sessions() as session:
        worker_store.register_worker(session, worker_id=worker_id, model=model,
                                     hostname=socket.gethostname(), pid=os.getpid())
    return ShardRunner(engine=engine, sessions=sessions, model=model, worker_id=worker_id, settings=settings)


def process_worker() -> ShardRunner:
    """This process's runner (engine loaded on first call, then reused by every task)."""
    global _process_runner
    with _lock:
        if _process_runner is None:
            settings = get_settings()
            model = process_model or settings.default_model
            _process_runner = make_runner(model=model, settings=settings, **process_engine_overrides)
        return _process_runner


def run_process_shard(shard_id: int) -> RunStats:
    """Claim `shard_id` (a no-op if it is taken), then keep this process's engine busy until no shard is left.

    What the Celery task run_shard does; `shutdown_requested` (a warm shutdown) hands held shards back.
    """
    return process_worker().work(first_shard_id=shard_id, stop=shutdown_requested)


def rescue_once(settings: Settings | None = None) -> shard_store.RescueReport:
    """One rescue pass: expired leases back to the queue (or failed after max_attempts)."""
    settings = settings or get_settings()
    with session_factory(settings.effective_database_url)() as session:
        return shard_store.rescue_expired(session)


def run_job(*, job_id: int, runner: ShardRunner, on_progress: ProgressCallback | None = None,
            stop: threading.Event | None = None) -> RunStats:
    """Work through one job's shards in this process (the local mode of `batchinfer run`)."""
    return runner.work(job_id=job_id, on_progress=on_progress, stop=stop)


def poll_forever(runner: ShardRunner, *, stop: threading.Event, max_backoff_s: float = 5.0) -> None:
    """The broker-less worker: claim available shards from the database, backing off while idle."""
    backoff = 0.2
    while not stop.is_set():
        rescue_once(runner.settings)
        stats = runner.work(stop=stop)
        if stats.shards_completed or stats.shards_released:
            backoff = 0.2
            continue
        with runner.sessions() as session:
            worker_store.worker_heartbeat(session, worker_id=runner.worker_id)
        stop.wait(backoff)
        backoff = min(max_backoff_s, backoff * 2)
    with runner.sessions() as session:
        worker_store.deregister_worker(session, worker_id=runner.worker_id)
