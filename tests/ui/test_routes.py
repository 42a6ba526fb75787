"""The dashboard's routes without a browser: sign-in rules, CSRF, security headers, the chart's data.

These run wherever the browser tests skip (no Chromium), on a real app and SQLite database.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.api.ui.auth import COOKIE_NAME
from batchinfer.api.ui.templating import CONTENT_SECURITY_POLICY
from batchinfer.config import Settings
from batchinfer.store.apikeys import create_key, revoke_key
from batchinfer.store.columns import utcnow
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import submit_job
from batchinfer.store.shards import claim_shard, pending_requests, write_results
from tests.workers.helpers import write_requests

HTMX = {"HX-Request": "true"}


@pytest.fixture
def setup(tmp_path: Path, sqlite_url: str) -> tuple[TestClient, Settings, str, int]:
    upgrade(sqlite_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, default_model="m", shard_size=4)
    with session_factory(sqlite_url)() as session:
        key, row = create_key(session, name="alice", owner="alice")
    return TestClient(create_app(settings, auth_cache_ttl_s=0)), settings, key, row.id


def test_without_a_valid_key_pages_go_to_the_sign_in_form(setup: tuple) -> None:
    client, settings, key, key_id = setup
    assert client.get("/ui", follow_redirects=False).headers["location"] == "/ui/login"
    fragment = client.get("/ui/jobs", headers=HTMX)
    assert fragment.status_code == 401 and fragment.headers["HX-Redirect"] == "/ui/login"
    assert client.post("/ui/login", data={"api_key": key}, follow_redirects=False).status_code == 303
    assert client.get("/ui").status_code == 200
    with session_factory(settings.effective_database_url)() as session:
        revoke_key(session, key_id=key_id)
    gone = client.get("/ui", follow_redirects=False)  # revoked: signed out at once
    assert gone.status_code == 303 and gone.headers["location"] == "/ui/login"
    assert COOKIE_NAME in gone.headers["set-cookie"] and "Max-Age=0" in gone.headers["set-cookie"]


def test_pages_carry_the_security_headers_and_actions_need_htmx(setup: tuple, tmp_path: Path) -> None:
    client, _, key, _ = setup
    client.post("/ui/login", data={"api_key": key})
    page = client.get("/ui")
    assert page.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "<script>" not in page.text  # no inline script
    write_requests(tmp_path / "in.jsonl", 2)
    files = {"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())}
    assert client.post("/ui/jobs", files=files, data={"purpose": "batch"}).status_code == 403  # no HX-Request
    too_long = client.post("/ui/jobs", files=files, data={"purpose": "batch", "model": "m" * 300},
                           headers=HTMX)
    assert too_long.status_code == 400 and "Invalid model" in too_long.text
    created = client.post("/ui/jobs", files=files, data={"purpose": "batch", "model": "m"}, headers=HTMX)
    assert created.headers["HX-Redirect"] == "/ui/batches/batch_1"
    assert client.post("/ui/batches/batch_1/cancel").status_code == 403
    assert client.post("/ui/batches/batch_1/cancel", headers=HTMX).status_code == 200


def test_auth_disabled_opens_the_dashboard_as_local(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, auth_disabled=True)
    client = TestClient(create_app(settings), base_url="http://127.0.0.1:8000")  # loopback only
    assert client.get("/ui/login", follow_redirects=False).headers["location"] == "/ui"
    assert "signed in as <b>local</b>" in client.get("/ui").text


def test_the_chart_shows_tokens_per_second_from_the_first_claim(setup: tuple, tmp_path: Path) -> None:
    client, settings, key, _ = setup
    client.post("/ui/login", data={"api_key": key})
    write_requests(tmp_path / "in.jsonl", 8)
    sessions = session_factory(settings.effective_database_url)
    claimed = utcnow() - timedelta(seconds=30)
    with sessions() as session:
        job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="alice")
        lease = claim_shard(session, worker_id="w", model="m", lease_seconds=600, now=claimed)
        results = [{"request_id": r.request_id, "prompt_tokens": 3, "completion_tokens": 60,
                    "cached_tokens": 0, "choices": [{"text": "ok", "finish_reason": "stop"}]}
                   for r in pending_requests(session, shard_id=lease.shard_id)]
        write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=results)
    data = client.get(f"/ui/batches/batch_{job.id}/timeline").json()
    assert data["final"] is False
    assert data["at"][0] == pytest.approx(claimed.timestamp(), abs=0.01) and data["tokens_per_second"][0] == 0
    assert len(data["at"]) == len(data["tokens_per_second"]) >= 3
    assert data["at"] == sorted(data["at"])
    # 4 requests x 60 tokens, all written just now: they land in the last bucket (a 1 s bucket of 30 s).
    widths = [b - a for a, b in zip(data["at"], data["at"][1:], strict=False)]
    assert sum(rate * width for rate, width in zip(data["tokens_per_second"][1:], widths, strict=True)) == (
        pytest.approx(240, rel=0.02))
    assert client.get("/ui/batches/batch_999/timeline").status_code == 404


def test_the_batch_page_reads_honestly(setup: tuple, tmp_path: Path) -> None:
    # Issue 29 item 5: a failed 0/0 batch is no full bar; the tiles say which figure is an average; the
    # generated tokens count running requests; an embeddings batch shows input tokens/s, not 0.0 tok/s.
    from batchinfer.store.progress import InflightReport
    from batchinfer.store.shards import heartbeat

    client, settings, key, _ = setup
    client.post("/ui/login", data={"api_key": key})
    sessions = session_factory(settings.effective_database_url)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    write_requests(tmp_path / "in.jsonl", 4)
    with (tmp_path / "embed.jsonl").open("w") as out:
        for i in range(4):
            out.write(f'{{"custom_id": "e{i}", "method": "POST", "url": "/v1/embeddings", '
                      f'"body": {{"model": "m", "input": "text {i}"}}}}\n')
    with sessions() as session:
        failed = submit_job(session, settings=settings, path=tmp_path / "bad.jsonl", model="m", owner="alice")
        running = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="alice")
        lease = claim_shard(session, worker_id="w", model="m", lease_seconds=600, shard_id=None,
                            now=utcnow() - timedelta(seconds=10))
        assert lease is not None and lease.job_id == running.id
        assert heartbeat(session, shard_id=lease.shard_id, lease_token=lease.lease_token, lease_seconds=600,
                         inflight=InflightReport(requests=4, tokens=120, budget=400))
        embeds = submit_job(session, settings=settings, path=tmp_path / "embed.jsonl", model="m",
                            owner="alice")
        lease = claim_shard(session, worker_id="w", model="m", lease_seconds=600,
                            now=utcnow() - timedelta(seconds=10))
        assert lease is not None and lease.job_id == embeds.id
        write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=[
            {"request_id": r.request_id, "embeddings": [[0.5, 0.5]], "prompt_tokens": 25,
             "completion_tokens": 0, "cached_tokens": 0}
            for r in pending_requests(session, shard_id=lease.shard_id)])
    assert failed.status == "failed" and failed.total_requests == 0
    page = client.get(f"/ui/batches/batch_{failed.id}").text
    assert re.search(r'<progress class="big" max="100" value="0(\.0)?">', page), "a failed 0/0 is no full bar"
    status = client.get(f"/ui/batches/batch_{running.id}/status", headers=HTMX).text
    assert "Tokens/s <small>average</small>" in status
    assert re.search(r'id="generated">120<', status)  # running requests' tokens, before any finished
    assert re.search(r'id="eta">0:\d\d<', status)  # 280 tokens left at ~12 tok/s
    status = client.get(f"/ui/batches/batch_{embeds.id}/status", headers=HTMX).text
    assert "Input tokens/s <small>average</small>" in status
    rate = float(re.search(r'id="rate">([\d.]+)<', status).group(1))
    assert rate == pytest.approx(100 / 10, rel=0.3)  # 4 inputs x 25 tokens embedded in ~10 s


def test_an_idle_workers_rate_is_zero_whatever_its_last_busy_heartbeat_said(setup: tuple) -> None:
    from batchinfer.store.workers import register_worker

    client, settings, key, _ = setup
    client.post("/ui/login", data={"api_key": key})
    now = utcnow().timestamp()
    with session_factory(settings.effective_database_url)() as session:
        register_worker(session, worker_id="busy", model="m",
                        info={"tokens_per_second": 42.5, "generated_at": now - 1})
        register_worker(session, worker_id="idle", model="m",  # heartbeats, generates nothing for 60 s
                        info={"tokens_per_second": 17.7, "generated_at": now - 60})
    table = client.get("/ui/workers", headers=HTMX).text
    assert "Tokens/s <small>now</small>" in table
    rows = dict(re.findall(r'data-worker="(\w+)">.*?<td class="num">([\d.]+)</td>', table, re.S))
    assert rows == {"busy": "42.5", "idle": "0.0"}


def test_the_upload_form_names_a_path_model_by_its_directory(tmp_path: Path, sqlite_url: str) -> None:
    from batchinfer.api.ui.views import model_choices

    upgrade(sqlite_url)
    model = str(tmp_path / "models" / "tiny-llama")
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, default_model=model)
    with session_factory(sqlite_url)() as session:
        key, _ = create_key(session, name="alice", owner="alice")
    client = TestClient(create_app(settings, auth_cache_ttl_s=0))
    client.post("/ui/login", data={"api_key": key})
    home = client.get("/ui").text
    assert 'value="tiny-llama"' in home and str(tmp_path) not in home  # no temp or home path on show
    write_requests(tmp_path / "in.jsonl", 2)
    files = {"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())}
    created = client.post("/ui/jobs", files=files, data={"purpose": "batch", "model": "tiny-llama"},
                          headers=HTMX)
    batch_id = created.headers["HX-Redirect"].rsplit("/", 1)[1]
    batch = client.get(f"/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert batch["model"] == model  # the shown name runs the served model
    # Two paths of one name, or a name that is another model's: shown whole, never confused.
    assert model_choices(["/a/llama", "/b/llama", "/c/sql", "sql", "org/hub-model"]) == {
        "/a/llama": "/a/llama", "/b/llama": "/b/llama", "/c/sql": "/c/sql", "sql": "sql",
        "org/hub-model": "org/hub-model"}
