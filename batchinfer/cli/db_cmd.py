"""`batchinfer db upgrade`: run the schema migrations (the only way the schema changes)."""

from __future__ import annotations

import click

from batchinfer.cli.context import cli_settings
from batchinfer.cli.output import emit, json_option
from batchinfer.config import mask_url_password


@click.group()
def db() -> None:
    """Manage the job database."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Alembic revision to upgrade to.")
@json_option("Print the database and revision as one JSON object.")
def upgrade(revision: str, as_json: bool) -> None:
    """Create or migrate the database schema."""
    from batchinfer.store.db import upgrade as run_upgrade

    settings = cli_settings()
    url = settings.effective_database_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    run_upgrade(url, revision)
    emit({"database_url": mask_url_password(url), "revision": revision},
         f"database at {mask_url_password(url)} is at revision {revision}")
