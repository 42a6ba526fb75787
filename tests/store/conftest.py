"""Store fixtures: a freshly migrated database on SQLite and (when the server is up) PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from sqlalchemy.orm import Session

from batchinfer.store.db import get_engine, session_factory, upgrade


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated, empty database: SQLite always, PostgreSQL via the pg_url fixture (skipped if absent)."""
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    upgrade(url)
    yield url
    get_engine(url).dispose()  # let pg_url drop its database


@pytest.fixture
def sqlite_db(sqlite_url: str) -> str:
    """A migrated SQLite database only (for tests that are about SQLite)."""
    upgrade(sqlite_url)
    return sqlite_url


@pytest.fixture
def make_session(db_url: str) -> Callable[[], Session]:
    """A sessionmaker for the migrated database."""
    return session_factory(db_url)


@pytest.fixture
def session(make_session: Callable[[], Session]) -> Iterator[Session]:
    with make_session() as s:
        yield s
