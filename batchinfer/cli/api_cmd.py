"""`batchinfer api`: serve the OpenAI-compatible REST API with uvicorn."""

from __future__ import annotations

import click

from batchinfer.config import get_settings


@click.command("api")
@click.option("--host", default=None, help="Address to bind (default: settings.api_host, 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default: settings.api_port, 8000).")
@click.option("--auth-disabled", is_flag=True, default=None,
              help="Serve without API keys (everything belongs to owner 'local'). Loopback hosts only.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def api(host: str | None, port: int | None, auth_disabled: bool | None, log_level: str) -> None:
    """Serve /v1/files, /v1/batches, /metrics and /docs. Run `batchinfer worker` to execute the batches."""
    import uvicorn

    from batchinfer.api.app import create_app, is_loopback
    from batchinfer.store.db import upgrade

    updates: dict[str, object] = {}
    if host is not None:
        updates["api_host"] = host
    if port is not None:
        updates["api_port"] = port
    if auth_disabled:
        updates["auth_disabled"] = True
    settings = get_settings().model_copy(update=updates)
    if settings.auth_disabled:
        if not is_loopback(settings.api_host):
            raise click.UsageError(
                f"--auth-disabled is refused on {settings.api_host}: anyone who can reach it could run and read "
                "batches. Bind 127.0.0.1, or create a key with `batchinfer apikey create --name NAME`."
            )
        click.secho("WARNING: authentication is DISABLED. Every request acts as owner 'local'; "
                    f"only {settings.api_host} (loopback) can reach this server.", fg="red", bold=True, err=True)
    upgrade(settings.effective_database_url)
    app = create_app(settings)
    click.echo(f"batchinfer API on http://{settings.api_host}:{settings.api_port} (docs at /docs)", err=True)
    uvicorn.run(app, host=settings.api_host, port=settings.api_port, log_level=log_level)
