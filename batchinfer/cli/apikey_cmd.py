"""`batchinfer apikey create|list|revoke`: manage the API keys of the REST API (stored hashed)."""

from __future__ import annotations

import click

from batchinfer.config import get_settings


def _session():  # noqa: ANN202 - sqlalchemy is imported lazily
    from batchinfer.store.db import session_factory, upgrade

    url = get_settings().effective_database_url
    upgrade(url)
    return session_factory(url)()


@click.group()
def apikey() -> None:
    """Create, list and revoke API keys for `batchinfer api`."""


@apikey.command("create")
@click.option("--name", required=True, help="A label for the key (also its owner unless --owner is given).")
@click.option("--owner", default=None, help="The owner whose files and batches the key sees (default: NAME). "
              "Give several keys the same owner to rotate them.")
def create(name: str, owner: str | None) -> None:
    """Create a key and print it once: it is stored hashed and cannot be shown again."""
    from batchinfer.store.apikeys import create_key

    with _session() as session:
        try:
            plaintext, row = create_key(session, name=name, owner=owner)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    click.echo(plaintext)
    click.echo(f"(key id {row.id}, owner {row.owner!r}; store it now: it will not be shown again)", err=True)


@apikey.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked keys.")
def list_(include_revoked: bool) -> None:
    """List keys: id, name, owner, prefix, created, last used, revoked (never the key itself)."""
    from batchinfer.store.apikeys import list_keys

    def when(value: object) -> str:
        return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"  # type: ignore[attr-defined]

    with _session() as session:
        rows = list_keys(session, include_revoked=include_revoked)
    if not rows:
        click.echo("no API keys (create one with `batchinfer apikey create --name NAME`)")
        return
    header = ("ID", "NAME", "OWNER", "PREFIX", "CREATED", "LAST USED", "REVOKED")
    table = [header] + [(str(r.id), r.name or "", r.owner, r.prefix + "...", when(r.created_at),
                         when(r.last_used_at), when(r.revoked_at)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


@apikey.command("revoke")
@click.argument("key_id", type=int)
def revoke(key_id: int) -> None:
    """Revoke the key with id KEY_ID (requests with it get 401 from now on)."""
    from batchinfer.store.apikeys import revoke_key

    with _session() as session:
        row = revoke_key(session, key_id=key_id)
    if row is None:
        raise click.ClickException(f"no API key with id {key_id} (see `batchinfer apikey list --all`)")
    click.echo(f"revoked key {row.id} ({row.name}, owner {row.owner!r})")
