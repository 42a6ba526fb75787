"""`batchinfer worker` (one per GPU), `batchinfer workers` (who is alive), `batchinfer beat` and `rescue`.

Who runs which periodic duty in each deployment shape: workers.duties (and the README's "Reliability").
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

import click
import orjson

from batchinfer.cli.engine_flags import (
    engine_overrides,
    float32_matmul_precision_option,
    kv_cache_dtype_option,
)
from batchinfer.cli.lora_options import check_adapters, lora_options, with_lora_settings
from batchinfer.cli.output import emit, fail, json_option, stdout_to_stderr
from batchinfer.config import get_settings
from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.layers.quantization import QUANTIZATIONS

if TYPE_CHECKING:
    from batchinfer.store.shards import RescueReport


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.command()
@click.option("--model", "-m", default=None,
              help="The model this worker serves (default: settings.default_model).")
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: settings.device).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None, help="GPUs per engine.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16", "half", "float"]),
              default=None,
              help="Weights and activations (default: settings.dtype; auto: bf16 where the CPU has it, "
                   "float32 under int8 weights).")
@kv_cache_dtype_option
@float32_matmul_precision_option
@click.option("--quantization", type=click.Choice(list(QUANTIZATIONS)), default=None,
              help="int8: int8 weights and dynamic int8 GEMMs on CPU; gguf: a .gguf model's own "
                   "Q4_0 / Q4_1 / Q8_0 blocks on CPU (default: settings.quantization).")
@click.option("--pipeline-parallel-size", type=click.IntRange(min=1), default=None,
              help="Stages of layers (e.g. one per node).")
@click.option("--distributed-executor-backend", type=click.Choice(["mp", "ray"]), default=None,
              help="Start the ranks as local processes (mp) or as actors on a running Ray cluster (ray).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port (default: settings.worker_metrics_port; 0: off).")
@lora_options
@click.option("--log-level", default="info", show_default=True)
@json_option("Print the start line as one JSON object on stdout (model, mode, queue, pid).")
def worker(model: str | None, device: str | None, tensor_parallel_size: int | None, dtype: str | None,
           kv_cache_dtype: str | None, float32_matmul_precision: str | None, quantization: str | None,
           pipeline_parallel_size: int | None, distributed_executor_backend: str | None,
           metrics_port: int | None, lora_modules: tuple[str, ...], max_loras: int | None,
           max_lora_rank: int | None, max_cpu_loras: int | None, log_level: str, as_json: bool) -> None:
    """Run a long-lived worker: Celery on the model's queue with a broker, else poll the database."""
    import workers.process as process
    from batchinfer.cli.backend import LocalBackend

    _setup_logging(log_level)
    settings = with_lora_settings(get_settings(), lora_modules=lora_modules, max_loras=max_loras,
                                  max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
    model = model or settings.default_model
    LocalBackend(settings)  # migrates an embedded SQLite database on first use
    overrides = engine_overrides(device=device, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                 kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                 float32_matmul_precision=float32_matmul_precision,
                                 pipeline_parallel_size=pipeline_parallel_size,
                                 distributed_executor_backend=distributed_executor_backend)
    check_adapters(settings, model, {**settings.engine_kwargs(), **overrides})
    process.process_model = model
    process.process_settings = settings  # with the command line's LoRA adapters
    process.process_engine_overrides = overrides
    process.process_metrics_port = metrics_port if metrics_port is not None else settings.worker_metrics_port
    from workers.duties import presence_duty, start_duties, worker_duties

    duties_stop = threading.Event()  # rescue + expiry beside the shards, whatever runs beat (duties.py)
    if settings.broker_url:
        from workers.app import queue_name
        from workers.celery_app import worker_app
        from workers.dispatch import rescue_and_redispatch

        app = worker_app()
        _say_rescued(rescue_and_redispatch(app=app, settings=settings))
        # The solo pool runs tasks in this process (no fork): load the engine (and register the worker) now,
        # so "ready" means ready and the first shard does not wait for the model.
        process.process_worker()
        start_duties([*worker_duties(settings, app=app), presence_duty(process.heartbeat_process_worker)],
                     stop=duties_stop)
        node = f"batchinfer-{os.path.basename(model)}-{os.getpid()}@%h"
        emit({"event": "worker_started", "model": model, "mode": "celery", "queue": queue_name(model),
              "pid": os.getpid()})
        if as_json:
            stdout_to_stderr()  # Celery's banner and shutdown lines: stdout stays the one JSON line
        try:
            queues = ",".join(queue_name(name) for name in (model, *sorted(settings.lora_modules)))
            app.worker_main(["worker", "--pool=solo", "--concurrency=1", "-Q", queues, "-n", node,
                             f"--loglevel={log_level.upper()}", "--without-gossip", "--without-mingle"])
        finally:
            duties_stop.set()
        return

    _say_rescued(process.rescue_once(settings))
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        click.echo(f"received signal {signum}: finishing in-flight work and releasing shards", err=True)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # As with Celery: the engine is loaded (and the worker registered) before the start line says so.
    runner = process.make_runner(model=model, settings=settings, metrics_port=process.process_metrics_port,
                                 **overrides)
    database = settings.public_dict()["database_url"]
    emit({"event": "worker_started", "model": model, "mode": "poll", "database_url": database,
          "pid": os.getpid()}, None if as_json else f"worker for {model}: polling {database} (no broker)",
         err=not as_json)
    if as_json:
        stdout_to_stderr()
    start_duties(worker_duties(settings), stop=duties_stop)
    try:
        process.poll_forever(runner, stop=stop)
    except RankFailedError as exc:  # the runner handed the shards back; no step can run: exit, be restarted
        from workers.tasks import EXIT_ENGINE_LOST

        click.echo(f"worker: {exc}; its shards were handed back; exiting", err=True)
        sys.exit(EXIT_ENGINE_LOST)
    finally:
        duties_stop.set()


@click.command("workers")
@click.option("--all", "include_dead", is_flag=True, help="Include workers that stopped or went silent.")
@json_option("One JSON object per worker.")
def workers_(include_dead: bool, as_json: bool) -> None:
    """List live workers and the shards they hold."""
    from batchinfer.cli.backend import LocalBackend
    from batchinfer.store.workers import list_workers

    backend = LocalBackend(get_settings())
    with backend.sessions() as session:
        infos = list_workers(session, include_dead=include_dead)
    for info in infos:
        adapters = (info.info or {}).get("lora_adapters", [])  # served like models (store.workers)
        if as_json:
            click.echo(orjson.dumps({"id": info.worker_id, "model": info.model, "live": info.live,
                                     "last_heartbeat_at": info.last_heartbeat_at.isoformat(),
                                     "shards": info.shard_ids, "lora_adapters": adapters}).decode())
        else:
            state = "live" if info.live else "gone"
            served = f"  lora_adapters={','.join(adapters)}" if adapters else ""
            click.echo(f"{info.worker_id}  {info.model}  {state}  shards={info.shard_ids}{served}")
    if not infos and not as_json:
        click.echo("no live workers")


@click.command()
@click.option("--log-level", default="info", show_default=True)
@json_option("Print the start line as one JSON object on stdout.")
def beat(log_level: str, as_json: bool) -> None:
    """Run the periodic duties of a broker deployment: rescue, expiry, schedule ticks and webhooks.

    They run in this process at their intervals (settings *_interval_seconds / *_seconds), and the
    control queue is consumed too (tasks a separate `celery beat` sends). Run one or more: every duty is
    single-flight in the database. Without a broker use `batchinfer scheduler`.
    """
    from batchinfer.cli.backend import LocalBackend

    _setup_logging(log_level)
    settings = get_settings()
    if not settings.broker_url:
        fail("beat needs a broker (BATCHINFER_BROKER_URL); without one run `batchinfer scheduler` "
             "(schedules, expiry) beside `batchinfer worker` (rescue, expiry)")
    from workers.app import CONTROL_QUEUE
    from workers.celery_app import worker_app
    from workers.duties import control_duties, start_duties

    LocalBackend(settings)  # migrates an embedded SQLite database on first use
    app = worker_app()
    stop = threading.Event()
    start_duties(control_duties(settings, app=app), stop=stop)
    emit({"event": "beat_started", "rescue_interval_seconds": settings.effective_rescue_interval_s,
          "expiry_sweep_seconds": settings.expiry_sweep_seconds,
          "schedule_tick_seconds": settings.schedule_tick_seconds, "pid": os.getpid()},
         None if as_json else f"beat: rescue every {settings.effective_rescue_interval_s:g}s, expiry every "
         f"{settings.expiry_sweep_seconds:g}s, schedule tick every {settings.schedule_tick_seconds:g}s",
         err=not as_json)
    if as_json:
        stdout_to_stderr()  # Celery's banner and shutdown lines: stdout stays the one JSON line
    try:
        app.worker_main(["worker", "--pool=solo", "--concurrency=1", "-Q", CONTROL_QUEUE,
                         "-n", f"batchinfer-control-{os.getpid()}@%h", f"--loglevel={log_level.upper()}",
                         "--without-gossip", "--without-mingle"])
    finally:
        stop.set()


@click.command()
@json_option("Print {requeued, failed, cancelled} as one JSON object.")
def rescue(as_json: bool) -> None:
    """Return shards whose lease expired to the queue now (or fail them after max attempts), and fail jobs
    whose submit died mid-ingest."""
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
    emit({"requeued": report.requeued, "failed": report.failed, "cancelled": report.cancelled,
          "lost_ingests": report.lost_ingests},
         f"requeued {report.requeued}, failed {report.failed}, cancelled {report.cancelled}, "
         f"lost ingests failed (jobs) {report.lost_ingests}")


def _say_rescued(report: RescueReport) -> None:
    if report.requeued or report.failed:
        click.echo(f"rescued expired shards: requeued {report.requeued}, failed {report.failed}", err=True)
    if report.lost_ingests:
        click.echo(f"failed jobs whose submit died mid-ingest: {report.lost_ingests}", err=True)
