"""`batchinfer db upgrade`: run the schema migrations (the only way the schema changes)."""

from __future__ import annotations

import click

from batchinfer.config import get_settings, mask_url_password


@click.group()
def db() -> None:
    """Manage the job database."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Alembic revision to upgrade to.")
def upgrade(revision: str) -> None:
    """Create or migrate the database schema."""
    from batchinfer.store.db import upgrade as run_upgrade

    settings = get_settings()
    url = settings.effective_database_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    run_upgrade(url, revision)
    click.echo(f"database at {mask_url_password(url)} is at revision {revision}")
