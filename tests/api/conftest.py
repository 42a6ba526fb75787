"""Fixtures of the API tests: settings on a fresh SQLite file, the app, a TestClient, API keys."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from tests.api.helpers import key_maker

TEST_MODEL = "fixed-output-model"  # served by tests.api.helpers.FixedOutputWorker


def make_settings(tmp_path: Path, database_url: str, **overrides: object) -> Settings:
    """Settings for one test: its own data dir and database, small limits."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "database_url": database_url,
        "default_model": TEST_MODEL,
        "api_host": "127.0.0.1",
        "max_upload_bytes": 1 << 20,
        "shard_size": 4,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def api_settings(tmp_path: Path, sqlite_url: str) -> Settings:
    """Settings on a migrated, empty SQLite database."""
    upgrade(sqlite_url)
    return make_settings(tmp_path, sqlite_url)


@pytest.fixture
def app(api_settings: Settings) -> FastAPI:
    """The API app."""
    return create_app(api_settings)


@pytest.fixture
def factory(api_settings: Settings) -> sessionmaker[Session]:
    """Sessions on the test database."""
    return session_factory(api_settings.effective_database_url)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """An in-process client; server errors come back as 500 responses instead of exceptions."""
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def make_key(factory: sessionmaker[Session]) -> Callable[..., tuple[str, int]]:
    """Create an API key: make_key(name, owner=None) -> (plaintext, key id)."""

    return key_maker(factory)


@pytest.fixture
def auth(make_key: Callable[..., tuple[str, int]]) -> dict[str, str]:
    """Authorization headers of owner 'alice'."""
    key, _ = make_key("alice")
    return {"Authorization": f"Bearer {key}"}
