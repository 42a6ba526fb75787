"""The `batchinfer` command line: parse arguments, call a service, print the result.

Each concept has its own module defining click commands; they are registered on `main` here. Command
modules stay import-light (torch and the engine are imported inside the commands that need them) so
`batchinfer status` answers quickly.
"""

from __future__ import annotations

import importlib

import click

from batchinfer import __version__

# (module, attribute) of every command registered on the main group.
_COMMANDS: list[tuple[str, str]] = [
    ("batchinfer.cli.config_cmd", "config"),
    ("batchinfer.cli.db_cmd", "db"),
    ("batchinfer.cli.jobs", "submit"),
    ("batchinfer.cli.jobs", "status"),
    ("batchinfer.cli.jobs", "list_"),
    ("batchinfer.cli.jobs", "results"),
    ("batchinfer.cli.jobs", "cancel"),
    ("batchinfer.cli.jobs", "run"),
    ("batchinfer.cli.worker_cmd", "worker"),
    ("batchinfer.cli.worker_cmd", "workers_"),
    ("batchinfer.cli.worker_cmd", "beat"),
    ("batchinfer.cli.worker_cmd", "rescue"),
    ("batchinfer.cli.schedule_cmd", "schedule"),
    ("batchinfer.cli.schedule_cmd", "scheduler"),
    ("batchinfer.cli.api_cmd", "api"),
    ("batchinfer.cli.apikey_cmd", "apikey"),
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchinfer")
def main() -> None:
    """batchinfer: batch LLM inference from JSONL files, on a laptop or a GPU fleet."""


for _module, _attr in _COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))
