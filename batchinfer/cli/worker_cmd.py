"""`batchinfer worker` (one per GPU), `batchinfer workers` (who is alive), `batchinfer beat` and `rescue`."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

import click
import orjson

from batchinfer.config import get_settings

if TYPE_CHECKING:
    from batchinfer.store.shards import RescueReport


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.command()
@click.option("--model", "-m", default=None,
              help="The model this worker serves (default: settings.default_model).")
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: settings.device).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None, help="GPUs per engine.")
@click.option("--log-level", default="info", show_default=True)
def worker(model: str | None, device: str | None, tensor_parallel_size: int | None, log_level: str) -> None:
    """Run a long-lived worker: Celery on the model's queue with a broker, else poll the database."""
    import workers.process as process
    from batchinfer.cli.backend import LocalBackend

    _setup_logging(log_level)
    settings = get_settings()
    model = model or settings.default_model
    LocalBackend(settings)  # migrates an embedded SQLite database on first use
    overrides = {}
    if device:
        overrides["device"] = device
    if tensor_parallel_size:
        overrides["tensor_parallel_size"] = tensor_parallel_size
    process.process_model = model
    process.process_engine_overrides = overrides
    if settings.broker_url:
        import os

        from workers.app import queue_name
        from workers.celery_app import worker_app
        from workers.dispatch import rescue_and_redispatch

        app = worker_app()
        _say_rescued(rescue_and_redispatch(app=app, settings=settings))
        # The solo pool runs tasks in this process (no fork): load the engine (and register the worker) now,
        # so "ready" means ready and the first shard does not wait for the model.
        process.process_worker()
        node = f"batchinfer-{os.path.basename(model)}-{os.getpid()}@%h"
        app.worker_main(["worker", "--pool=solo", "--concurrency=1", "-Q", queue_name(model), "-n", node,
                         f"--loglevel={log_level.upper()}", "--without-gossip", "--without-mingle"])
        return

    _say_rescued(process.rescue_once(settings))
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        click.echo(f"received signal {signum}: finishing in-flight work and releasing shards", err=True)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    click.echo(f"worker for {model}: polling {settings.public_dict()['database_url']} (no broker)", err=True)
    process.poll_forever(process.make_runner(model=model, settings=settings, **overrides), stop=stop)


@click.command("workers")
@click.option("--all", "include_dead", is_flag=True, help="Include workers that stopped or went silent.")
@click.option("--json", "as_json", is_flag=True)
def workers_(include_dead: bool, as_json: bool) -> None:
    """List live workers and the shards they hold."""
    from batchinfer.cli.backend import LocalBackend
    from batchinfer.store.workers import list_workers

    backend = LocalBackend(get_settings())
    with backend.sessions() as session:
        infos = list_workers(session, include_dead=include_dead)
    for info in infos:
        if as_json:
            click.echo(orjson.dumps({"id": info.worker_id, "model": info.model, "live": info.live,
                                     "last_heartbeat_at": info.last_heartbeat_at.isoformat(),
                                     "shards": info.shard_ids}).decode())
        else:
            state = "live" if info.live else "gone"
            click.echo(f"{info.worker_id}  {info.model}  {state}  shards={info.shard_ids}")
    if not infos and not as_json:
        click.echo("no live workers")


@click.command()
@click.option("--log-level", default="info", show_default=True)
def beat(log_level: str) -> None:
    """Run Celery beat: the periodic rescuer and the schedule tick (needs a broker)."""
    settings = get_settings()
    if not settings.broker_url:
        click.echo("error: beat needs a broker (BATCHINFER_BROKER_URL); without one `batchinfer worker` "
                   "rescues on its own", err=True)
        sys.exit(1)
    from workers.celery_app import worker_app

    worker_app().start(["beat", f"--loglevel={log_level.upper()}"])


@click.command()
def rescue() -> None:
    """Return shards whose lease expired to the queue now (or fail them after max attempts)."""
    from batchinfer.cli.backend import LocalBackend
    from workers.process import rescue_once

    settings = get_settings()
    LocalBackend(settings)
    if settings.broker_url:
        from workers.app import get_app
        from workers.dispatch import rescue_and_redispatch

        report = rescue_and_redispatch(app=get_app(), settings=settings)
    else:
        report = rescue_once(settings)
    click.echo(f"requeued {report.requeued}, failed {report.failed}, cancelled {report.cancelled}")


def _say_rescued(report: RescueReport) -> None:
    if report.requeued or report.failed:
        click.echo(f"rescued expired shards: requeued {report.requeued}, failed {report.failed}", err=True)
