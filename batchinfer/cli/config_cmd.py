"""`batchinfer config show`: the effective settings, secrets masked."""

from __future__ import annotations

import click
import orjson

from batchinfer.config import get_settings


@click.group()
def config() -> None:
    """Inspect batchinfer's settings."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def show(as_json: bool) -> None:
    """Print the effective settings (environment, config file and defaults merged)."""
    values = get_settings().public_dict()
    if as_json:
        click.echo(orjson.dumps(values, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())
        return
    width = max(len(name) for name in values)
    for name in sorted(values):
        click.echo(f"{name.ljust(width)}  {values[name]}")
