"""Alembic environment: migrations run online against batchinfer's engine (same pragmas as the app)."""

from __future__ import annotations

from alembic import context

from batchinfer.store.db import make_engine
from batchinfer.store.models import Base

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    """`-x url=...`, then sqlalchemy.url, then the BATCHINFER_DATABASE_URL setting."""
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from batchinfer.config import get_settings

        url = get_settings().effective_database_url
    return url


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs go through table copies
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
