"""Schedules: nightly pipelines stored in the database, turned into exactly one job per cron slot.

Exactly once per slot: a ScheduleRun row is inserted for (schedule, slot) before anything else happens,
and UNIQUE(schedule_id, slot_at) makes a second tick (or a second beat) for the same slot a no-op.
Catch-up after downtime: `latest` (default) runs only the newest missed slot, `all` runs each one,
`none` skips missed slots and waits for the next. Slots are computed with croniter in the schedule's
timezone and stored in UTC.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchinfer.config import Settings, get_settings
from batchinfer.destinations import (
    DestinationRefused,
    absolute_template,
    check_schedule_path,
    check_webhook_form,
    schedule_roots,
)
from batchinfer.store import LOCAL_OWNER
from batchinfer.store.db import write_transaction
from batchinfer.store.models import Schedule, ScheduleRun, ScheduleRunStatus, WebhookDelivery, utcnow
from batchinfer.wire.json_types import JSONObject

CATCHUP_POLICIES = ("latest", "all", "none")
MAX_SLOTS_PER_TICK = 1000  # `all` after a long outage never floods the queue in one tick


class ScheduleError(ValueError):
    """A schedule that cannot be created or found; the message names the field."""


def validate_schedule(*, cron: str, timezone: str, catchup: str, input_template: str,
                      output_template: str | None) -> None:
    """Raise ScheduleError naming the field when a schedule definition is not usable."""
    if not croniter.is_valid(cron):
        raise ScheduleError(f"cron: {cron!r} is not a valid cron expression "
                            "(e.g. '0 2 * * *' for 02:00 daily)")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"timezone: {timezone!r} is unknown; use an IANA name like 'Europe/Rome'") \
            from None
    if catchup not in CATCHUP_POLICIES:
        raise ScheduleError(f"catchup: must be one of {', '.join(CATCHUP_POLICIES)}, got {catchup!r}")
    for field, template in (("input", input_template), ("output", output_template)):
        if template is None:
            continue
        try:
            render_template(template, datetime(2000, 1, 2, 3, 4, tzinfo=ZoneInfo("UTC")), name="x")
        except (KeyError, ValueError, IndexError) as exc:
            raise ScheduleError(f"{field}: template {template!r} is not valid ({exc}); use fields like "
                                "{date:%Y-%m-%d} and {name}") from None


def render_template(template: str, slot_local: datetime, *, name: str) -> str:
    """Fill `{date:...}` (the slot in the schedule's timezone), `{name}` and `{slot}` into a path template."""
    return template.format(date=slot_local, name=name, slot=slot_local.strftime("%Y%m%dT%H%M"))


def add_schedule(session: Session, *, name: str, cron: str, input_template: str, model: str,
                 timezone: str = "UTC", output_template: str | None = None,
                 errors_template: str | None = None, params: JSONObject | None = None,
                 webhook_url: str | None = None, webhook_secret: str | None = None, catchup: str = "latest",
                 owner: str = LOCAL_OWNER, settings: Settings | None = None,
                 result_cache: str | None = None, now: datetime | None = None) -> Schedule:
    """Create an enabled schedule; its first slot is the first cron time after `now`.

    Its jobs belong to `owner`: LOCAL_OWNER (the default) makes them the local CLI's own, so `status`,
    `list`, `results` and `cancel` see them. Relative path templates are stored absolute, against the
    working directory of this call; its paths must lie in schedule_roots and its webhook be a well-formed
    http(s) URL, not to a private address written in it (batchinfer.destinations, under `settings`,
    default the process settings; the name's addresses are checked at each delivery).
    """
    input_template = absolute_template(input_template)
    output_template = absolute_template(output_template) if output_template is not None else None
    errors_template = absolute_template(errors_template) if errors_template is not None else None
    validate_schedule(cron=cron, timezone=timezone, catchup=catchup, input_template=input_template,
                      output_template=output_template)
    if errors_template is not None:
        validate_schedule(cron=cron, timezone=timezone, catchup=catchup, input_template=errors_template,
                          output_template=None)
    check_destinations(settings or get_settings(), webhook_url=webhook_url,
                       templates={"input": input_template, "output": output_template,
                                  "errors": errors_template})
    now = now or utcnow()
    schedule = Schedule(name=name, owner=owner, cron=cron, timezone=timezone, input_template=input_template,
                        model=model, output_template=output_template, errors_template=errors_template,
                        params=params or None, webhook_url=webhook_url, webhook_secret=webhook_secret,
                        catchup=catchup, enabled=True, created_at=now, last_slot_at=now,
                        result_cache=result_cache)
    try:
        with write_transaction(session):
            session.add(schedule)
    except IntegrityError:
        raise ScheduleError(f"name: a schedule called {name!r} exists already") from None
    return schedule


def check_destinations(settings: Settings, *, webhook_url: str | None,
                       templates: dict[str, str | None]) -> None:
    """ScheduleError unless the webhook's form and every path template (rendered for a sample slot) are
    allowed."""
    roots = schedule_roots(settings)
    sample = datetime(2000, 1, 2, 3, 4, tzinfo=ZoneInfo("UTC"))
    try:
        for field, template in templates.items():
            if template is not None:
                check_schedule_path(render_template(template, sample, name="x"), roots, field=field)
        if webhook_url is not None:
            check_webhook_form(webhook_url, allow_private=settings.webhook_allow_private)
    except DestinationRefused as exc:
        raise ScheduleError(str(exc)) from None


def get_schedule(session: Session, *, name: str) -> Schedule:
    """The schedule called `name`, or ScheduleError."""
    schedule = session.scalar(select(Schedule).where(Schedule.name == name))
    if schedule is None:
        raise ScheduleError(f"no schedule called {name!r} (see `batchinfer schedule list`)")
    return schedule


def list_schedules(session: Session) -> list[Schedule]:
    """All schedules by name."""
    return list(session.scalars(select(Schedule).order_by(Schedule.name)))


def set_enabled(session: Session, *, name: str, enabled: bool, now: datetime | None = None) -> Schedule:
    """Pause or resume; resuming does not run the slots missed while paused (catch-up starts at now)."""
    with write_transaction(session):
        schedule = get_schedule(session, name=name)
        if enabled and not schedule.enabled:
            schedule.last_slot_at = now or utcnow()
        schedule.enabled = enabled
    return schedule


def remove_schedule(session: Session, *, name: str) -> None:
    """Delete a schedule and its run history (jobs stay)."""
    with write_transaction(session):
        schedule = get_schedule(session, name=name)
        session.delete(schedule)


def list_runs(session: Session, *, schedule_id: int, limit: int = 20) -> list[ScheduleRun]:
    """A schedule's latest runs, newest first."""
    return list(session.scalars(select(ScheduleRun).where(ScheduleRun.schedule_id == schedule_id)
                                .order_by(ScheduleRun.slot_at.desc()).limit(limit)))


def next_slot(schedule: Schedule, *, after: datetime) -> datetime:
    """The first cron slot strictly after `after`, in UTC."""
    zone = ZoneInfo(schedule.timezone)
    return croniter(schedule.cron, after.astimezone(zone)).get_next(datetime).astimezone(ZoneInfo("UTC"))


def due_slots(schedule: Schedule, *, now: datetime) -> tuple[list[datetime], datetime | None]:
    """(slots in (last_slot_at, now] this tick runs after the catch-up policy, the newest slot passed)."""
    zone = ZoneInfo(schedule.timezone)
    if schedule.last_slot_at is None:  # set when the schedule is created
        raise ValueError(f"schedule {schedule.id}: last_slot_at is not set")
    itr = croniter(schedule.cron, schedule.last_slot_at.astimezone(zone))
    slots: list[datetime] = []
    while len(slots) < MAX_SLOTS_PER_TICK:
        slot = itr.get_next(datetime).astimezone(ZoneInfo("UTC"))
        if slot > now:
            break
        slots.append(slot)
    if not slots:
        return [], None
    latest = slots[-1]
    if schedule.catchup == "latest":
        return [latest], latest
    if schedule.catchup == "none":
        # Only a slot due within the last tick interval runs; older ones were missed while down.
        return ([latest] if now - latest < timedelta(minutes=2) else []), latest
    return slots, latest


def claim_slot(session: Session, *, schedule: Schedule, slot_at: datetime,
               manual: bool = False, now: datetime | None = None) -> ScheduleRun | None:
    """Insert the run for (schedule, slot) and advance last_slot_at; None if another tick already did."""
    run = ScheduleRun(schedule_id=schedule.id, slot_at=slot_at, status=ScheduleRunStatus.PENDING,
                      manual=manual, created_at=now or utcnow())
    try:
        with write_transaction(session):
            session.add(run)
            current = session.get(Schedule, schedule.id, populate_existing=True)
            if current is not None and not manual and (current.last_slot_at is None
                                                       or slot_at > current.last_slot_at):
                current.last_slot_at = slot_at
    except IntegrityError:
        return None
    return run


def mark_skipped_slots(session: Session, *, schedule: Schedule, up_to: datetime) -> None:
    """Advance last_slot_at past slots the catch-up policy decided not to run."""
    with write_transaction(session):
        current = session.get(Schedule, schedule.id, populate_existing=True)
        if current is not None and (current.last_slot_at is None or up_to > current.last_slot_at):
            current.last_slot_at = up_to


def update_run(session: Session, *, run_id: int, **values: object) -> ScheduleRun:
    """Set fields of a run (status, job_id, error, output paths, finished_at) in one transaction."""
    with write_transaction(session):
        run = session.get(ScheduleRun, run_id, populate_existing=True)
        if run is None:
            raise ScheduleError(f"schedule run {run_id} not found")
        for key, value in values.items():
            setattr(run, key, value)
    return run


def stale_pending_runs(session: Session, *, claimed_before: datetime) -> list[ScheduleRun]:
    """Runs claimed before `claimed_before` and never submitted: their ticker died between the two."""
    return list(session.scalars(select(ScheduleRun).where(ScheduleRun.status == ScheduleRunStatus.PENDING,
                                                          ScheduleRun.created_at < claimed_before)
                                .order_by(ScheduleRun.id)))


def runs_awaiting_outputs(session: Session) -> list[ScheduleRun]:
    """Runs whose job was submitted and whose outputs are not written yet."""
    return list(session.scalars(select(ScheduleRun).where(ScheduleRun.status == ScheduleRunStatus.SUBMITTED)
                                .order_by(ScheduleRun.id)))


def enqueue_webhook(session: Session, *, run: ScheduleRun, url: str, payload: bytes,
                    now: datetime | None = None) -> WebhookDelivery:
    """Record a webhook call to make (the outbox); delivery retries it until it succeeds or gives up."""
    delivery = WebhookDelivery(run_id=run.id, url=url, payload=payload.decode(), attempts=0,
                               next_attempt_at=now or utcnow(), created_at=now or utcnow())
    with write_transaction(session):
        session.add(delivery)
    return delivery


def due_webhooks(session: Session, *, now: datetime, limit: int = 50) -> list[WebhookDelivery]:
    """Undelivered webhooks whose next attempt is due."""
    return list(session.scalars(select(WebhookDelivery).where(
        WebhookDelivery.delivered_at.is_(None), WebhookDelivery.gave_up_at.is_(None),
        WebhookDelivery.next_attempt_at <= now).order_by(WebhookDelivery.id).limit(limit)))


def record_webhook_attempt(session: Session, *, delivery_id: int, ok: bool, error: str | None, now: datetime,
                           max_attempts: int, base_delay_s: float) -> WebhookDelivery:
    """Count an attempt: delivered, or retried after an exponential backoff, or given up."""
    with write_transaction(session):
        delivery = session.get(WebhookDelivery, delivery_id, populate_existing=True)
        assert delivery is not None
        delivery.attempts += 1
        delivery.last_attempt_at = now
        if ok:
            delivery.delivered_at = now
            delivery.last_error = None
        else:
            delivery.last_error = (error or "")[:1000]
            if delivery.attempts >= max_attempts:
                delivery.gave_up_at = now
            else:
                backoff_s = base_delay_s * 2 ** (delivery.attempts - 1)
                delivery.next_attempt_at = now + timedelta(seconds=backoff_s)
    return delivery
