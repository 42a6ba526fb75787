"""What the command line adds to the settings: `--server URL` (before or after the command name).

`batchinfer --server URL status batch_1` and `batchinfer status --server URL batch_1` both talk to that
server instead of the database, as `BATCHINFER_SERVER` does; the option wins over the variable.
"""

from __future__ import annotations

from typing import Any

import click

from batchinfer.config import Settings, get_settings

_SERVER_KEY = "batchinfer.server"  # ctx.meta is shared by a command and its parents


def _remember_server(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        ctx.meta[_SERVER_KEY] = value
    return value


server_option = click.option(
    "--server", metavar="URL", default=None, expose_value=False, callback=_remember_server,
    help="Talk to this batchinfer API server instead of the database (env BATCHINFER_SERVER; "
         "the key comes from BATCHINFER_API_KEY).")


def cli_settings(**updates: Any) -> Settings:
    """The process settings with what the command line set (--server, then `updates`) applied."""
    settings = get_settings()
    ctx = click.get_current_context(silent=True)
    server = ctx.meta.get(_SERVER_KEY) if ctx else None
    if server:
        updates = {"server": server, **updates}
    return settings.model_copy(update=updates) if updates else settings
