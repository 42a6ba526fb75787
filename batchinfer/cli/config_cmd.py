"""`batchinfer config show`: the effective settings, secrets masked, and where each value came from."""

from __future__ import annotations

import click

from batchinfer.cli.output import dumps, json_option
from batchinfer.config import get_settings, setting_sources


@click.group()
def config() -> None:
    """Inspect batchinfer's settings."""


@config.command("show")
@click.option("--sources", is_flag=True,
              help="Also say where each value came from: env BATCHINFER_<NAME>, file PATH, or default.")
@json_option("Print one JSON object (with --sources: {name: {value, source}}).")
def show(sources: bool, as_json: bool) -> None:
    """Print the effective settings (environment, config file and defaults merged)."""
    values = get_settings().public_dict()
    origin = setting_sources() if sources else {}
    if as_json:
        shown = ({name: {"value": value, "source": origin.get(name, "derived")}
                  for name, value in values.items()} if sources else values)
        click.echo(dumps(dict(sorted(shown.items()))))  # one line, as every --json output
        return
    width = max(len(name) for name in values)
    for name in sorted(values):
        suffix = f"  ({origin.get(name, 'derived')})" if sources else ""
        click.echo(f"{name.ljust(width)}  {values[name]}{suffix}")
