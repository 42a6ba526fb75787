"""The migrated schema is exactly the models (alembic autogenerate finds nothing), on both databases."""

from __future__ import annotations

import subprocess
import sys

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from batchinfer.store.db import alembic_config, get_engine
from batchinfer.store.models import Base


def test_migrations_match_the_models(db_url):
    with get_engine(db_url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
        head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
        assert context.get_current_revision() == head


def test_sqlite_pragmas_are_set(sqlite_db):
    with get_engine(sqlite_db).connect() as connection:
        pragma = connection.exec_driver_sql
        assert pragma("PRAGMA journal_mode").scalar() == "wal"
        assert pragma("PRAGMA foreign_keys").scalar() == 1
        assert pragma("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert pragma("PRAGMA busy_timeout").scalar() >= 1000


def test_downgrade_and_upgrade_again(sqlite_db):
    config = alembic_config(sqlite_db)
    command.downgrade(config, "base")
    engine = get_engine(sqlite_db)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    command.upgrade(config, "head")
    tables = set(inspect(engine).get_table_names())
    assert {"jobs", "shards", "requests", "files", "workers", "api_keys"} <= tables


def test_the_store_never_imports_torch():
    modules = ", ".join(f"batchinfer.store.{name}" for name in (
        "db", "models", "ingest", "jobs", "shards", "transitions", "results", "export", "workers", "stats",
        "files", "apikeys", "schedules", "serialize"))
    code = (f"import sys, {modules}, batchinfer.wire.input_line; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
