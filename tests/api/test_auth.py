"""The auth matrix: no key, wrong key, revoked key -> 401; another owner's ids -> 404; nothing leaks."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from batchinfer.api.app import UnsafeConfiguration, create_app, is_loopback
from batchinfer.store.apikeys import authenticate, create_key, hash_key, list_keys, revoke_key
from batchinfer.store.db import session_factory
from batchinfer.store.models import ApiKey
from tests.api.conftest import make_settings
from tests.api.helpers import chat_line, jsonl

GOOD = jsonl([chat_line("a", "hello"), chat_line("b", "world")])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def every_route(file_id: str, batch_id: str) -> list[tuple[str, str, dict]]:
    """(method, path, request kwargs) of every authenticated route."""
    return [
        ("GET", "/v1/files", {}),
        ("POST", "/v1/files", {"data": {"purpose": "batch"}, "files": {"file": ("x.jsonl", GOOD)}}),
        ("GET", f"/v1/files/{file_id}", {}),
        ("GET", f"/v1/files/{file_id}/content", {}),
        ("DELETE", f"/v1/files/{file_id}", {}),
        ("GET", "/v1/batches", {}),
        ("POST", "/v1/batches", {"json": {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}}),
        ("GET", f"/v1/batches/{batch_id}", {}),
        ("POST", f"/v1/batches/{batch_id}/cancel", {}),
    ]


@pytest.fixture
def alice_objects(client: TestClient, make_key) -> tuple[str, str, str]:
    """Alice's key, one of her files and one of her batches."""
    key, _ = make_key("alice")
    file_id = client.post("/v1/files", headers=bearer(key), data={"purpose": "batch"},
                          files={"file": ("in.jsonl", GOOD)}).json()["id"]
    batch = client.post("/v1/batches", headers=bearer(key), json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    return key, file_id, batch["id"]


def assert_401(response, *, secret: str | None = None) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    if secret:
        assert secret not in response.text
        assert secret[:8] not in response.text  # not even a prefix of what was sent


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
    {"Authorization": "bi-not-even-bearer"},
], ids=["none", "empty", "bearer-without-key", "basic", "no-scheme"])
def test_missing_or_malformed_key_is_401_everywhere(client, alice_objects, headers):
    _, file_id, batch_id = alice_objects
    for method, path, kwargs in every_route(file_id, batch_id):
        assert_401(client.request(method, path, headers=headers, **kwargs))


def test_wrong_key_is_401_without_echoing_it(client, alice_objects):
    key, file_id, batch_id = alice_objects
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for method, path, kwargs in every_route(file_id, batch_id):
        assert_401(client.request(method, path, headers=bearer(wrong), **kwargs), secret=wrong)
    huge = "bi-" + "x" * 10_000
    assert_401(client.get("/v1/batches", headers=bearer(huge)), secret=huge)


def test_revoked_key_is_401_and_other_keys_keep_working(client, factory, make_key, alice_objects):
    from batchinfer.api.deps import AUTH_CACHE_TTL_S

    key, file_id, batch_id = alice_objects
    second, _ = make_key("alice-rotated", owner="alice")
    with factory() as session:
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(key)))
        revoke_key(session, key_id=key_id)
    time.sleep(AUTH_CACHE_TTL_S)  # status polls may trust a key for this long (see the cache test below)
    for method, path, kwargs in every_route(file_id, batch_id):
        assert_401(client.request(method, path, headers=bearer(key), **kwargs), secret=key)
    # A second key of the same owner still sees alice's objects.
    assert client.get(f"/v1/batches/{batch_id}", headers=bearer(second)).status_code == 200


def test_other_owners_ids_are_404_like_unknown_ids(client, make_key, alice_objects):
    _, file_id, batch_id = alice_objects
    bob, _ = make_key("bob")
    for method, path, kwargs in every_route(file_id, batch_id)[2:]:
        if path in ("/v1/batches",) and method == "GET":
            continue
        response = client.request(method, path, headers=bearer(bob), **kwargs)
        assert response.status_code == 404, (method, path, response.text)
        assert "alice" not in response.text
        # Indistinguishable from an id that never existed (same message with the id swapped).
        unknown = path.replace(file_id, "file-987654").replace(batch_id, "batch_987654")
        unknown_kwargs = kwargs
        if "json" in kwargs:
            unknown_kwargs = {"json": {**kwargs["json"], "input_file_id": "file-987654"}}
        twin = client.request(method, unknown, headers=bearer(bob), **unknown_kwargs)
        assert twin.status_code == 404
        assert twin.json()["error"]["message"].replace("987654", "X") == \
            response.json()["error"]["message"].replace(file_id.split("-")[-1], "X").replace(
                batch_id.split("_")[-1], "X")
    # Bob's lists are empty, alice's objects untouched.
    assert client.get("/v1/files", headers=bearer(bob)).json()["data"] == []
    assert client.get("/v1/batches", headers=bearer(bob)).json()["data"] == []


def test_creating_a_batch_from_another_owners_file_is_404_on_input_file_id(client, make_key, alice_objects):
    _, file_id, _ = alice_objects
    bob, _ = make_key("bob")
    response = client.post("/v1/batches", headers=bearer(bob), json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "input_file_id"


def test_keys_are_stored_hashed_and_authenticate_to_their_owner(factory):
    with factory() as session:
        plaintext, row = create_key(session, name="ci", owner="team-a")
        assert plaintext.startswith("bi-") and len(plaintext) >= 40
        stored = session.scalars(select(ApiKey)).one()
        assert stored.key_hash == hash_key(plaintext) and plaintext not in (stored.key_hash, stored.prefix)
        assert stored.prefix == plaintext[:10]
        assert stored.last_used_at is None
        assert authenticate(session, key=plaintext) == "team-a"
        session.refresh(stored)
        assert stored.last_used_at is not None
        assert authenticate(session, key=plaintext + "x") is None
        assert authenticate(session, key="") is None
        revoke_key(session, key_id=row.id)
        assert authenticate(session, key=plaintext) is None
        assert revoke_key(session, key_id=12345) is None
        assert [k.id for k in list_keys(session, include_revoked=False)] == []
        assert [k.id for k in list_keys(session)] == [row.id]


def test_auth_disabled_only_on_loopback(tmp_path, sqlite_url):
    assert all(is_loopback(host) for host in ("127.0.0.1", "::1", "[::1]", "localhost"))
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.com")
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        with pytest.raises(UnsafeConfiguration, match="loopback"):
            create_app(make_settings(tmp_path, sqlite_url, auth_disabled=True, api_host=host))
    create_app(make_settings(tmp_path, sqlite_url, auth_disabled=False, api_host="0.0.0.0"))  # keys: fine


def test_auth_disabled_everything_belongs_to_local(tmp_path, sqlite_url):
    from batchinfer.store.db import upgrade

    upgrade(sqlite_url)
    app = create_app(make_settings(tmp_path, sqlite_url, auth_disabled=True))
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a loopback Host (api/loopback.py)
        response = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", GOOD)})
        assert response.status_code == 200
        file_id = response.json()["id"]
        assert client.get(f"/v1/files/{file_id}", headers=bearer("anything")).status_code == 200
        from batchinfer.store.models import File

        with session_factory(sqlite_url)() as session:
            assert session.scalars(select(File.owner)).all() == ["local"]


def test_poll_caches_bound_how_long_a_revoked_key_and_a_status_can_lag(client, factory, make_key,
                                                                        alice_objects):
    from batchinfer.api.deps import AUTH_CACHE_TTL_S, STATUS_CACHE_TTL_S
    from batchinfer.store.jobs import cancel_job
    from batchinfer.store.serialize import parse_batch_id

    key, _, batch_id = alice_objects
    bob, _ = make_key("bob")
    poll = f"/v1/batches/{batch_id}"
    assert client.get(poll, headers=bearer(key)).json()["status"] == "in_progress"  # now in both caches
    assert client.get(poll, headers=bearer(bob)).status_code == 404  # the cache still checks the owner

    with factory() as session:  # a change the API process did not make (a worker, the CLI)
        cancel_job(session, job_id=parse_batch_id(batch_id), owner="alice")
        revoke_key(session, key_id=session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(key))))
    stale = client.get(poll, headers=bearer(key))
    assert stale.status_code == 200 and stale.json()["status"] == "in_progress"  # within the TTLs
    time.sleep(max(AUTH_CACHE_TTL_S, STATUS_CACHE_TTL_S) + 0.1)
    assert_401(client.get(poll, headers=bearer(key)), secret=key)
    second, _ = make_key("alice-2", owner="alice")
    assert client.get(poll, headers=bearer(second)).json()["status"] == "cancelled"


def test_caches_can_be_disabled(api_settings, make_key):
    app = create_app(api_settings, auth_cache_ttl_s=0, status_cache_ttl_s=0)
    key, key_id = make_key("alice")
    with TestClient(app) as client:
        file_id = client.post("/v1/files", headers=bearer(key), data={"purpose": "batch"},
                              files={"file": ("in.jsonl", GOOD)}).json()["id"]
        batch = client.post("/v1/batches", headers=bearer(key), json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions"}).json()
        assert client.get(f"/v1/batches/{batch['id']}", headers=bearer(key)).status_code == 200
        with session_factory(api_settings.effective_database_url)() as session:
            revoke_key(session, key_id=key_id)
        assert_401(client.get(f"/v1/batches/{batch['id']}", headers=bearer(key)), secret=key)


def test_steady_polling_sees_changes_and_revocation_within_the_ttls(client, factory, alice_objects):
    from batchinfer.api.deps import AUTH_CACHE_TTL_S, STATUS_CACHE_TTL_S
    from batchinfer.store.jobs import cancel_job
    from batchinfer.store.serialize import parse_batch_id

    key, _, batch_id = alice_objects
    poll = f"/v1/batches/{batch_id}"

    def first_time(predicate, limit: float) -> float:
        start = time.monotonic()
        while not predicate(client.get(poll, headers=bearer(key))):
            assert time.monotonic() - start < limit, "change not seen in time"
            time.sleep(0.02)
        return time.monotonic() - start

    for _ in range(30):  # warm both caches with steady polling (refresh-ahead keeps them alive)
        client.get(poll, headers=bearer(key))
    with factory() as session:
        cancel_job(session, job_id=parse_batch_id(batch_id), owner="alice")
    first_time(lambda r: r.json()["status"] == "cancelled", STATUS_CACHE_TTL_S + 0.5)
    with factory() as session:
        revoke_key(session, key_id=session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(key))))
    first_time(lambda r: r.status_code == 401, AUTH_CACHE_TTL_S + 0.5)
