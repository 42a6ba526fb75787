"""`batchinfer schedule ...` (nightly pipelines) and `batchinfer scheduler` (the tick loop, no broker)."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import click
import orjson

from batchinfer.config import get_settings


def _sessions() -> Any:
    from batchinfer.cli.backend import LocalBackend

    return LocalBackend(get_settings()).sessions


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _describe(schedule: Any) -> dict[str, Any]:
    from batchinfer.store.models import utcnow
    from batchinfer.store.schedules import next_slot

    return {
        "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone,
        "enabled": schedule.enabled, "model": schedule.model, "input": schedule.input_template,
        "output": schedule.output_template, "errors": schedule.errors_template, "params": schedule.params,
        "webhook_url": schedule.webhook_url, "catchup": schedule.catchup,
        "next_run": next_slot(schedule, after=max(utcnow(), schedule.last_slot_at)).isoformat()
        if schedule.enabled else None,
    }


def _params(pairs: tuple[str, ...]) -> dict[str, Any] | None:
    """The --param KEY=VALUE defaults (VALUE read as JSON, else as a string), checked as a line's fields."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not key=value", param_hint="--param")
        try:
            out[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            out[key] = raw
    if out:
        from batchinfer.formats import LineError, check_sampling_fields

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
              help="Input path template, e.g. 'data/{date:%Y-%m-%d}/prompts.jsonl' (globs allowed).")
@click.option("--output", "output_template", default=None, help="Results path template.")
@click.option("--errors", "errors_template", default=None, help="Error lines path template.")
@click.option("--model", "-m", default=None, help="Model (default: settings.default_model).")
@click.option("--param", multiple=True, metavar="KEY=VALUE",
              help="Default sampling field for lines without it.")
@click.option("--webhook", "webhook_url", default=None, help="URL to POST when a run ends.")
@click.option("--webhook-secret", default=None,
              help="HMAC-SHA256 secret for the X-Batchinfer-Signature header.")
@click.option("--catchup", type=click.Choice(["latest", "all", "none"]), default="latest", show_default=True,
              help="After downtime: run the newest missed slot, every missed slot, or none.")
def add(name: str, cron: str, timezone: str, input_template: str, output_template: str | None,
        errors_template: str | None, model: str | None, param: tuple[str, ...], webhook_url: str | None,
        webhook_secret: str | None, catchup: str) -> None:
    """Create a schedule."""
    from batchinfer.store.schedules import ScheduleError, add_schedule

    with _sessions()() as session:
        try:
            created = add_schedule(session, name=name, cron=cron, timezone=timezone,
                                   input_template=input_template, output_template=output_template,
                                   errors_template=errors_template,
                                   model=model or get_settings().default_model, params=_params(param),
                                   webhook_url=webhook_url, webhook_secret=webhook_secret, catchup=catchup)
        except ScheduleError as exc:
            _fail(str(exc))
        info = _describe(created)
    click.echo(f"schedule {name}: next run {info['next_run']}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True)
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
                           f"next {info['next_run']}")


@schedule.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
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
    click.echo(f"schedule {name} {'resumed' if enabled else 'paused'}")


@schedule.command("pause")
@click.argument("name")
def pause(name: str) -> None:
    """Stop starting runs (until resume)."""
    _toggle(name, False)


@schedule.command("resume")
@click.argument("name")
def resume(name: str) -> None:
    """Start runs again from the next slot (slots missed while paused are skipped)."""
    _toggle(name, True)


@schedule.command("remove")
@click.argument("name")
def remove(name: str) -> None:
    """Delete a schedule and its run history (jobs stay)."""
    from batchinfer.store.schedules import ScheduleError, remove_schedule

    with _sessions()() as session:
        try:
            remove_schedule(session, name=name)
        except ScheduleError as exc:
            _fail(str(exc))
    click.echo(f"schedule {name} removed")


@schedule.command("run-now")
@click.argument("name")
def run_now_cmd(name: str) -> None:
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
    click.echo(f"schedule {name}: started batch_{run.job_id}")


@click.command()
@click.option("--interval", type=float, default=60.0, show_default=True, help="Seconds between ticks.")
def scheduler(interval: float) -> None:
    """Run the schedule tick in this process (no broker needed); Ctrl-C to stop."""
    from workers.cron import scheduler_loop

    _sessions()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    click.echo("scheduler running; jobs it submits are run by `batchinfer worker`", err=True)
    scheduler_loop(stop=stop, interval_s=interval)
