"""`batchinfer api`: serve the OpenAI-compatible REST API with uvicorn.

On SIGTERM / SIGINT uvicorn stops accepting connections and waits up to api_shutdown_timeout_seconds for
requests in flight (a slow upload included), then cancels them (their staged bytes are removed) and the
process exits. An ingest still running then is abandoned: its job fails when its ingest lease expires
(store.ingest_lease), as if the process had been killed.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading

import click

from batchinfer.cli.context import cli_settings
from batchinfer.cli.output import emit, json_option


@click.command("api")
@click.option("--host", default=None, help="Address to bind (default: settings.api_host, 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default: settings.api_port, 8000).")
@click.option("--auth-disabled", is_flag=True, default=None,
              help="Serve without API keys (everything belongs to owner 'local'). Loopback hosts only.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--access-log/--no-access-log", default=None,
              help="A line per request on stderr (default: settings.api_access_log, on).")
@json_option("Print the start line as one JSON object on stdout (url, host, port, auth, pid).")
def api(host: str | None, port: int | None, auth_disabled: bool | None, log_level: str,
        access_log: bool | None, as_json: bool) -> None:
    """Serve /v1/files, /v1/batches, /metrics and /docs. Run `batchinfer worker` to execute the batches."""
    import uvicorn

    from batchinfer.api.app import create_app, is_loopback
    from batchinfer.cli.backend import prepare_database

    updates: dict[str, object] = {}
    if host is not None:
        updates["api_host"] = host
    if port is not None:
        updates["api_port"] = port
    if auth_disabled:
        updates["auth_disabled"] = True
    if access_log is not None:
        updates["api_access_log"] = access_log
    settings = cli_settings(**updates)
    if settings.auth_disabled:
        if not is_loopback(settings.api_host):
            raise click.UsageError(
                f"--auth-disabled is refused on {settings.api_host}: anyone who can reach it could run and "
                "read batches. Bind 127.0.0.1, or create a key with `batchinfer apikey create --name NAME`."
            )
        click.secho("WARNING: authentication is DISABLED. Every request acts as owner 'local'; "
                    f"only {settings.api_host} (loopback) can reach this server.",
                    fg="red", bold=True, err=True)
    prepare_database(settings, migrate=True)  # a fresh data dir is created and migrated, as elsewhere
    app = create_app(settings)
    url = f"http://{settings.api_host}:{settings.api_port}"
    emit({"event": "api_started", "url": url, "host": settings.api_host, "port": settings.api_port,
          "auth_disabled": settings.auth_disabled, "pid": os.getpid()})
    if not as_json:
        click.echo(f"batchinfer API on {url} (docs at /docs)", err=True)
    config = uvicorn.Config(app, host=settings.api_host, port=settings.api_port, log_level=log_level,
                            access_log=settings.api_access_log, log_config=log_config(),
                            # uvicorn annotates int but waits any number of seconds (asyncio.wait_for)
                            timeout_graceful_shutdown=settings.api_shutdown_timeout_seconds)  # type: ignore[arg-type]
    uvicorn.Server(config).run()
    _exit_past_lingering_ingests()


ACCESS_LOG_FORMAT = '%(asctime)s %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'


def log_config() -> dict:
    """uvicorn's logging, with the access log timestamped and on stderr (stdout stays the start line only,
    pure JSON under --json)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config["formatters"]["access"]["fmt"] = ACCESS_LOG_FORMAT
    return config


def _exit_past_lingering_ingests() -> None:
    """Exit now even if ingest threads still run (the interpreter would join them: no bounded shutdown)."""
    lingering = [t for t in threading.enumerate() if t.name.startswith("batchinfer-ingest") and t.is_alive()]
    if not lingering:
        return
    logging.getLogger("batchinfer.api").warning(
        "%d ingest(s) still running are abandoned; their batches fail when their ingest lease expires",
        len(lingering))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
