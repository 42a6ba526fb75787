"""The `batchinfer` command line: parse arguments, call a service, print the result.

Each concept has its own module defining click commands; they are registered on `main` here. Command
modules stay import-light (torch and the engine are imported inside the commands that need them) so
`batchinfer status` answers quickly.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from batchinfer import __version__
from batchinfer.cli.context import server_option
from batchinfer.cli.output import EXIT_ERROR, show_error
from batchinfer.config_sources import ConfigError
from batchinfer.engine.native.threads import configure_openmp_env

# OpenMP reads its thread count and wait policy when torch is first imported (by `run`, `worker`): set the
# engine's defaults before any command can import it; a value in the environment wins.
configure_openmp_env()

# (module, attribute) of every command registered on the main group.
_COMMANDS: list[tuple[str, str]] = [
    ("batchinfer.cli.config_cmd", "config"),
    ("batchinfer.cli.db_cmd", "db"),
    ("batchinfer.cli.jobs", "submit"),
    ("batchinfer.cli.jobs", "status"),
    ("batchinfer.cli.jobs", "list_"),
    ("batchinfer.cli.jobs", "results"),
    ("batchinfer.cli.jobs", "cancel"),
    ("batchinfer.cli.retry_cmd", "retry"),
    ("batchinfer.cli.run_cmd", "run"),
    ("batchinfer.cli.estimate_cmd", "estimate"),
    ("batchinfer.cli.worker_cmd", "worker"),
    ("batchinfer.cli.worker_cmd", "workers_"),
    ("batchinfer.cli.worker_cmd", "beat"),
    ("batchinfer.cli.worker_cmd", "rescue"),
    ("batchinfer.cli.purge_cmd", "purge"),
    ("batchinfer.cli.schedule_cmd", "schedule"),
    ("batchinfer.cli.schedule_cmd", "scheduler"),
    ("batchinfer.cli.api_cmd", "api"),
    ("batchinfer.cli.apikey_cmd", "apikey"),
    ("batchinfer.cli.kernels_cmd", "build_kernels"),
]


class BatchinferGroup(click.Group):
    """The main group: bad settings and the failures of cli/failures.py are one error line (exit 1), and
    under --json every error, click's usage errors included, is one JSON object on stderr with the exit
    code it has without --json."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            show_error(str(exc), exit_code=EXIT_ERROR, type="config_error")
            sys.exit(EXIT_ERROR)
        except Exception as exc:  # a failure the user can fix is one line (cli/failures.py), a bug is not
            from batchinfer.cli.failures import describe_failure

            message = describe_failure(exc)
            if message is None:
                raise
            show_error(message, exit_code=EXIT_ERROR)
            sys.exit(EXIT_ERROR)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:  # Any: click's own signature (its extra is passed to the Context)
        argv = list(sys.argv[1:] if args is None else args)
        as_json = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
        if not (standalone_mode and as_json):
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            kind = "usage_error" if isinstance(exc, click.UsageError) else "error"
            show_error(exc.format_message(), exit_code=exc.exit_code, type=kind, as_json=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            show_error("aborted", exit_code=EXIT_ERROR, as_json=True)
            sys.exit(EXIT_ERROR)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=BatchinferGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchinfer")
@server_option
def main() -> None:
    """batchinfer: batch LLM inference from JSONL files, on a laptop or a GPU fleet."""


for _module, _attr in _COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))
