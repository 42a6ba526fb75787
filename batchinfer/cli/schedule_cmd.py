"""`batchinfer schedule ...` (nightly pipelines) and `batchinfer scheduler` (the tick loop, no broker)."""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, NotRequired, TypedDict

import click
import orjson

from batchinfer.cli.output import emit, fail, json_option
from batchinfer.config import get_settings
from batchinfer.wire.json_types import JSONObject

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from batchinfer.store.models import Schedule


class ScheduleObject(TypedDict):
    """A schedule as `schedule add|list|show` print it (`runs`: show's latest runs)."""

    name: str
    cron: str
    timezone: str
    enabled: bool
    model: str
    input: str
    output: str | None
    errors: str | None
    params: JSONObject | None
    webhook_url: str | None
    catchup: str
    result_cache: str | None
    next_run: str | None
    runs: NotRequired[list[dict[str, object]]]


def _sessions() -> sessionmaker[Session]:
    from batchinfer.cli.backend import LocalBackend

    return LocalBackend(get_settings()).sessions


def _fail(message: str) -> None:
    fail(message)  # one line, or a JSON object under --json (output.py)


def _next_run(schedule: Schedule) -> str | None:
    """The next slot in the schedule's own timezone (ISO 8601 with its offset), None while paused."""
    from zoneinfo import ZoneInfo

    from batchinfer.store.models import utcnow
    from batchinfer.store.schedules import next_slot

    if not schedule.enabled:
        return None
    slot = next_slot(schedule, after=max(utcnow(), schedule.last_slot_at or utcnow()))  # set on creation
    return slot.astimezone(ZoneInfo(schedule.timezone)).isoformat()


def _when(next_run: str | None, timezone: str) -> str:
    """'2026-12-04 02:30 Europe/Rome' for a next_run of _next_run."""
    return "-" if next_run is None else f"{next_run[:16].replace('T', ' ')} {timezone}"


def _describe(schedule: Schedule) -> ScheduleObject:
    return {
        "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone,
        "enabled": schedule.enabled, "model": schedule.model, "input": schedule.input_template,
        "output": schedule.output_template, "errors": schedule.errors_template, "params": schedule.params,
        "webhook_url": schedule.webhook_url, "catchup": schedule.catchup,
        "result_cache": schedule.result_cache,
        "next_run": _next_run(schedule),
    }


def _params(pairs: tuple[str, ...]) -> JSONObject | None:
    """The --param KEY=VALUE defaults (VALUE read as JSON, else as a string), checked as a line's fields."""
    out: JSONObject = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not key=value", param_hint="--param")
        try:
            out[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            out[key] = raw
    if out:
        from batchinfer.wire.input_line import check_sampling_fields
        from batchinfer.wire.request import LineError

        try:
            check_sampling_fields(out)
        except LineError as exc:
            raise click.BadParameter(f"{exc.param}: {exc.message}", param_hint="--param") from None
    return out or None


@click.group()
def schedule() -> None:
    """Nightly pipelines: run the same batch on a new file at every cron slot, exactly once."""


@schedule.command("add")
@click.argument("name")
@click.option("--cron", required=True, help="Cron expression, e.g. '0 2 * * *' (02:00 every day).")
@click.option("--timezone", "--tz", "timezone", default="UTC", show_default=True,
              help="IANA timezone of the cron.")
@click.option("--input", "input_template", required=True,
              help="Input path template, e.g. 'data/{date:%Y-%m-%d}/prompts.jsonl' (globs allowed; a "
                   "relative path is stored absolute, from the current directory).")
@click.option("--output", "output_template", default=None, help="Results path template (stored absolute).")
@click.option("--errors", "errors_template", default=None,
              help="Error lines path template (stored absolute).")
@click.option("--model", "-m", default=None, help="Model (default: settings.default_model).")
@click.option("--param", multiple=True, metavar="KEY=VALUE",
              help="Default sampling field for lines without it.")
@click.option("--webhook", "webhook_url", default=None, help="URL to POST when a run ends.")
@click.option("--webhook-secret", default=None,
              help="HMAC-SHA256 secret for the X-Batchinfer-Signature header.")
@click.option("--catchup", type=click.Choice(["latest", "all", "none"]), default="latest", show_default=True,
              help="After downtime: run the newest missed slot, every missed slot, or none.")
@click.option("--result-cache", type=click.Choice(["use", "refresh", "off"]), default=None,
              help="Its jobs' result cache: use (serve deterministic lines computed by earlier runs), "
              "refresh, off (default: settings.result_cache).")
@json_option("Print the schedule as one JSON object.")
def add(name: str, cron: str, timezone: str, input_template: str, output_template: str | None,
        errors_template: str | None, model: str | None, param: tuple[str, ...], webhook_url: str | None,
        webhook_secret: str | None, catchup: str, result_cache: str | None, as_json: bool) -> None:
    """Create a schedule."""
    from batchinfer.store.schedules import ScheduleError, add_schedule

    with _sessions()() as session:
        try:
            created = add_schedule(session, name=name, cron=cron, timezone=timezone,
                                   input_template=input_template, output_template=output_template,
                                   errors_template=errors_template,
                                   model=model or get_settings().default_model, params=_params(param),
                                   webhook_url=webhook_url, webhook_secret=webhook_secret, catchup=catchup,
                                   result_cache=result_cache)
        except ScheduleError as exc:
            _fail(str(exc))
        info = _describe(created)
    listed = (("input", info["input"]), ("output", info["output"]), ("errors", info["errors"]))
    paths = "".join(f"\n  {field:7} {value}" for field, value in listed if value)
    emit(info, f"schedule {name}: next run {_when(info['next_run'], info['timezone'])}{paths}")


@schedule.command("list")
@json_option("One JSON object per schedule.")
def list_(as_json: bool) -> None:
    """List schedules."""
    from batchinfer.store.schedules import list_schedules

    with _sessions()() as session:
        for item in list_schedules(session):
            info = _describe(item)
            if as_json:
                click.echo(orjson.dumps(info).decode())
            else:
                state = "enabled" if info["enabled"] else "paused"
                click.echo(f"{info['name']}  {info['cron']} ({info['timezone']})  {state}  "
                           f"next {_when(info['next_run'], info['timezone'])}")


@schedule.command("show")
@click.argument("name")
@json_option("Print the schedule and its runs as one JSON object.")
def show(name: str, as_json: bool) -> None:
    """Show a schedule and its latest runs."""
    from batchinfer.store.schedules import ScheduleError, get_schedule, list_runs

    with _sessions()() as session:
        try:
            item = get_schedule(session, name=name)
        except ScheduleError as exc:
            _fail(str(exc))
        info = _describe(item)
        info["runs"] = [{"slot": r.slot_at.isoformat(), "status": r.status, "job": f"batch_{r.job_id}"
                         if r.job_id else None, "output": r.output_path, "error": r.error}
                        for r in list_runs(session, schedule_id=item.id)]
    if as_json:
        click.echo(orjson.dumps(info).decode())
        return
    for key, value in info.items():
        if key != "runs":
            click.echo(f"{key:12} {value}")
    for run in info["runs"]:
        detail = run["error"] or run["output"] or ""
        click.echo(f"  {run['slot']}  {run['status']:<9}  {run['job'] or '-'}  {detail}")


def _toggle(name: str, enabled: bool) -> None:
    from batchinfer.store.schedules import ScheduleError, set_enabled

    with _sessions()() as session:
        try:
            set_enabled(session, name=name, enabled=enabled)
        except ScheduleError as exc:
            _fail(str(exc))
    emit({"name": name, "enabled": enabled}, f"schedule {name} {'resumed' if enabled else 'paused'}")


@schedule.command("pause")
@click.argument("name")
@json_option("Print {name, enabled} as one JSON object.")
def pause(name: str, as_json: bool) -> None:
    """Stop starting runs (until resume)."""
    _toggle(name, False)


@schedule.command("resume")
@click.argument("name")
@json_option("Print {name, enabled} as one JSON object.")
def resume(name: str, as_json: bool) -> None:
    """Start runs again from the next slot (slots missed while paused are skipped)."""
    _toggle(name, True)


@schedule.command("remove")
@click.argument("name")
@json_option("Print {name, removed} as one JSON object.")
def remove(name: str, as_json: bool) -> None:
    """Delete a schedule and its run history (jobs stay)."""
    from batchinfer.store.schedules import ScheduleError, remove_schedule

    with _sessions()() as session:
        try:
            remove_schedule(session, name=name)
        except ScheduleError as exc:
            _fail(str(exc))
    emit({"name": name, "removed": True}, f"schedule {name} removed")


@schedule.command("run-now")
@click.argument("name")
@json_option("Print {name, batch_id, slot} as one JSON object.")
def run_now_cmd(name: str, as_json: bool) -> None:
    """Start a run now, outside the cron slots."""
    from batchinfer.store.schedules import ScheduleError
    from workers.cron import run_now

    _sessions()
    try:
        run = run_now(name=name)
    except ScheduleError as exc:
        _fail(str(exc))
    if run.error:
        _fail(run.error)
    emit({"name": name, "batch_id": f"batch_{run.job_id}", "slot": run.slot_at.isoformat()},
         f"schedule {name}: started batch_{run.job_id}")


@click.command()
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds between schedule ticks (default: settings.schedule_tick_seconds).")
@json_option("Print the start line as one JSON object on stdout.")
def scheduler(interval: float | None, as_json: bool) -> None:
    """Run the periodic duties in this process (no broker needed): schedule ticks and webhooks, expiry,
    rescue. Ctrl-C to stop."""
    import logging

    from workers.duties import control_duties, run_duties

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    if interval is not None:
        settings = settings.model_copy(update={"schedule_tick_seconds": interval})
    _sessions()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    emit({"event": "scheduler_started", "schedule_tick_seconds": settings.schedule_tick_seconds,
          "pid": os.getpid()})
    if not as_json:
        click.echo(f"scheduler running (tick every {settings.schedule_tick_seconds:g}s); jobs it submits are "
                   "run by `batchinfer worker`", err=True)
    run_duties(control_duties(settings), stop=stop)
