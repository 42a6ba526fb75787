"""Issue 15 for schedules: webhook URLs (scheme, private addresses) and concurrent bounded delivery;
input and output paths confined to schedule_roots, at `schedule add` and at run time."""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.destinations import (
    DestinationRefused,
    absolute_template,
    check_webhook_form,
    check_webhook_url,
    pinned_webhook_request,
    schedule_roots,
)
from batchinfer.store import schedules as store
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.models import ScheduleRun, WebhookDelivery
from batchinfer.store.schedules import ScheduleError, add_schedule
from tests.workers.helpers import write_requests
from workers.cron import start_run
from workers.webhooks import deliver_webhooks

T0 = datetime(2026, 11, 1, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x", "gopher://1.2.3.4/", "http:///x",
                                 "http://127.0.0.1:8000/hook", "http://localhost/hook", "http://[::1]/hook",
                                 "http://169.254.169.254/latest/meta-data", "http://10.0.0.5/",
                                 "https://192.168.1.1/", "http://0.0.0.0/", "http://224.0.0.1/"])
def test_webhook_urls_refused(url: str) -> None:
    with pytest.raises(DestinationRefused, match="webhook"):
        check_webhook_url(url, allow_private=False)


def test_webhook_urls_allowed() -> None:
    check_webhook_url("https://93.184.216.34/hook", allow_private=False)  # a public address
    check_webhook_url("http://127.0.0.1:9/hook", allow_private=True)  # the setting loosens it
    with pytest.raises(DestinationRefused, match="http:// or https://"):
        check_webhook_url("file:///etc/passwd", allow_private=True)  # but never another scheme


def test_a_webhook_is_pinned_to_the_address_it_was_checked_at() -> None:
    pinned = pinned_webhook_request("https://93.184.216.34:8443/hook?x=1", allow_private=False)
    assert pinned.url == "https://93.184.216.34:8443/hook?x=1"
    assert pinned.headers == {"Host": "93.184.216.34:8443"}
    assert pinned.extensions == {"sni_hostname": "93.184.216.34"}  # TLS checks the certificate for the name
    loose = pinned_webhook_request("http://127.0.0.1:9/hook", allow_private=True)
    assert (loose.url, loose.headers, loose.extensions) == ("http://127.0.0.1:9/hook", {}, {})


def test_a_name_rebound_to_loopback_after_the_check_is_never_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: the name is public when checked and loopback a moment later; the POST goes to the
    checked address (unreachable here), never to the receiver listening on loopback."""
    import httpx

    hits: list[str] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    real = socket.getaddrinfo
    answers = iter(["93.184.216.34"])  # the first answer (the check) is public, every later one loopback

    def rebinding(host, *args, **kwargs):  # noqa: ANN001, ANN202
        if host == "rebind.example":
            return real(next(answers, "127.0.0.1"), *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    url = f"http://rebind.example:{port}/hook"
    try:
        pinned = pinned_webhook_request(url, allow_private=False)
        assert pinned.url == f"http://93.184.216.34:{port}/hook"
        assert pinned.headers == {"Host": f"rebind.example:{port}"}
        with httpx.Client(timeout=0.5) as client:
            with pytest.raises(httpx.TransportError):
                client.post(pinned.url, content=b"{}", headers=pinned.headers)
            assert client.post(url, content=b"{}").status_code == 200  # what an unpinned POST would hit
    finally:
        server.shutdown()
    assert hits == ["/hook"]  # only the unpinned control call reached the loopback receiver


def _settings(url: str, tmp_path: Path, **values: object) -> Settings:
    upgrade(url)
    return Settings(database_url=url, data_dir=tmp_path, **values)  # type: ignore[arg-type]


def _add(settings: Settings, tmp_path: Path, **fields: object):
    values: dict[str, object] = {"input_template": str(tmp_path / "in" / "{date:%Y-%m-%d}.jsonl")}
    values.update(fields)
    with session_factory(settings.effective_database_url)() as session:
        return add_schedule(session, name="s", cron="0 2 * * *", model="m", now=T0, settings=settings,
                            **values)  # type: ignore[arg-type]


def test_schedule_add_refuses_private_webhooks_and_paths_outside_the_roots(sqlite_url: str,
                                                                           tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path, webhook_allow_private=False, schedule_roots=[tmp_path])
    with pytest.raises(ScheduleError, match="webhook_allow_private"):
        _add(settings, tmp_path, webhook_url="http://169.254.169.254/latest/meta-data")
    with pytest.raises(ScheduleError, match=r"input: '/etc/\*' is outside .* schedule_roots"):
        _add(settings, tmp_path, input_template="/etc/*")
    with pytest.raises(ScheduleError, match="output: .* schedule_roots"):
        _add(settings, tmp_path, output_template=str(tmp_path / "{date:..}" / ".." / "elsewhere.jsonl"))
    with pytest.raises(ScheduleError, match="errors: .* schedule_roots"):
        _add(settings, tmp_path, errors_template="/var/tmp/{name}.errors.jsonl")
    _add(settings, tmp_path, output_template=str(tmp_path / "out" / "{date:%Y-%m-%d}.jsonl"))  # inside: fine
    default = _settings(sqlite_url, tmp_path, schedule_roots=[])  # default root: the data dir
    assert schedule_roots(default) == [tmp_path.resolve()]


def test_a_symlink_out_of_the_roots_fails_the_run(sqlite_url: str, tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "in").mkdir(parents=True)
    outside.mkdir()
    write_requests(outside / "secret.jsonl", 2)
    (root / "in" / "2026-11-01.jsonl").symlink_to(outside / "secret.jsonl")
    settings = _settings(sqlite_url, tmp_path, schedule_roots=[root])
    schedule = _add(settings, root)
    with session_factory(sqlite_url)() as session:
        run = store.claim_slot(session, schedule=schedule, slot_at=T0 + timedelta(hours=2))
    run = start_run(run=run, schedule=schedule, settings=settings, now=T0 + timedelta(hours=2))
    assert run.status == "failed" and "schedule_roots" in run.error and run.job_id is None


class _Receiver(http.server.BaseHTTPRequestHandler):
    delay_s = 0.0
    received: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(type(self).delay_s)
        type(self).received.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


class _Hanging(_Receiver):
    delay_s = 30.0


def _serve(handler: type) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_hanging_receiver_does_not_stall_the_others(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path, webhook_allow_private=True, webhook_timeout_seconds=1.0,
                         schedule_roots=[tmp_path])
    fast, hanging = _serve(_Receiver), _serve(_Hanging)
    _Receiver.received = []
    try:
        schedule = _add(settings, tmp_path)
        with session_factory(sqlite_url)() as session:
            run = store.claim_slot(session, schedule=schedule, slot_at=T0)
            urls = [f"http://127.0.0.1:{hanging.server_port}/slow"] + [
                f"http://127.0.0.1:{fast.server_port}/fast-{i}" for i in range(5)]
            for url in urls:
                store.enqueue_webhook(session, run=run, url=url, payload=b"{}", now=T0)
        start = time.monotonic()
        assert deliver_webhooks(settings=settings, now=T0) == 5
        assert time.monotonic() - start < 5  # one timeout, not one per delivery nor the receiver's 30 s
        assert sorted(_Receiver.received) == [f"/fast-{i}" for i in range(5)]
        with session_factory(sqlite_url)() as session:
            slow = session.scalars(select(WebhookDelivery).where(WebhookDelivery.url == urls[0])).one()
            assert slow.delivered_at is None and slow.attempts == 1
            assert "webhook_timeout_seconds" in slow.last_error or "Timeout" in slow.last_error
            assert session.scalars(select(ScheduleRun)).one().id == run.id
    finally:
        fast.shutdown()
        hanging.shutdown()


def test_delivery_rechecks_the_url(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path, webhook_allow_private=True, schedule_roots=[tmp_path])
    schedule = _add(settings, tmp_path, webhook_url="http://127.0.0.1:9/hook")  # allowed when added
    with session_factory(sqlite_url)() as session:
        run = store.claim_slot(session, schedule=schedule, slot_at=T0)
        store.enqueue_webhook(session, run=run, url="http://127.0.0.1:9/hook", payload=b"{}", now=T0)
    strict = settings.model_copy(update={"webhook_allow_private": False})
    assert deliver_webhooks(settings=strict, now=T0) == 0
    with session_factory(sqlite_url)() as session:
        assert "webhook_allow_private" in session.scalars(select(WebhookDelivery)).one().last_error


@pytest.mark.parametrize("url", ["https://hooks.example.com/batch", "http://receiver.invalid:8080/x",
                                 "https://93.184.216.34/hook", "https://b\u00fccher.example/hook"])
def test_schedule_add_checks_a_webhook_for_its_form_only(url: str) -> None:
    """A name need not resolve where the schedule is added (delivery checks its addresses)."""
    check_webhook_form(url, allow_private=False)


@pytest.mark.parametrize(("url", "says"), [
    ("ftp://hooks.example.com/x", "http:// or https://"), ("https:///x", "http:// or https://"),
    ("https://bad_host!.example.com/x", "not a valid host name"), ("https://-a.example.com/", "valid host"),
    ("https://hooks.example.com:99999/", "invalid port"), ("http://10.0.0.5/hook", "webhook_allow_private"),
    ("http://[::1]/hook", "webhook_allow_private")])
def test_a_malformed_or_literally_private_webhook_is_refused_at_add(url: str, says: str) -> None:
    with pytest.raises(DestinationRefused, match=re.escape(says)):
        check_webhook_form(url, allow_private=False)


def test_relative_templates_are_stored_absolute_from_where_add_ran(sqlite_url: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings(sqlite_url, tmp_path, schedule_roots=[tmp_path])
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    schedule = _add(settings, tmp_path, input_template="data/{date:%Y-%m-%d}/in.jsonl",
                    output_template="results/{date:%Y-%m-%d}.jsonl",
                    errors_template="results/{date:%Y-%m-%d}.errors.jsonl",
                    webhook_url="https://hooks.example.com/batch")
    work = tmp_path / "work"
    assert (schedule.input_template, schedule.output_template, schedule.errors_template) == (
        f"{work}/data/{{date:%Y-%m-%d}}/in.jsonl", f"{work}/results/{{date:%Y-%m-%d}}.jsonl",
        f"{work}/results/{{date:%Y-%m-%d}}.errors.jsonl")
    assert absolute_template("~/x/{name}.jsonl") == str(Path.home() / "x" / "{name}.jsonl")
    assert absolute_template("/abs/{name}") == "/abs/{name}"
