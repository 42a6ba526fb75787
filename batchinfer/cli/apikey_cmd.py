"""`batchinfer apikey create|list|revoke`: manage the API keys of the REST API (stored hashed)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, TypedDict

import click

from batchinfer.cli.output import emit, fail, json_option

if TYPE_CHECKING:
    from batchinfer.store.models import ApiKey


class KeyObject(TypedDict):
    """A key's public fields, as `apikey create|list|revoke` print them."""

    id: int
    name: str | None
    owner: str
    prefix: str
    created_at: str | None
    last_used_at: str | None
    revoked_at: str | None
    admin: bool
    weight: float


def _session():  # noqa: ANN202 - sqlalchemy is imported lazily
    """A session on the database, created and migrated on first use (a fresh data dir included)."""
    from batchinfer.cli.backend import prepare_database
    from batchinfer.cli.context import cli_settings
    from batchinfer.store.db import session_factory

    return session_factory(prepare_database(cli_settings(), migrate=True))()


def _key_object(row: ApiKey) -> KeyObject:
    """A key's public fields (never the key itself)."""

    def when(value: datetime | None) -> str | None:
        return value.isoformat() if value is not None else None

    return {"id": row.id, "name": row.name, "owner": row.owner, "prefix": row.prefix,
            "created_at": when(row.created_at), "last_used_at": when(row.last_used_at),
            "revoked_at": when(row.revoked_at), "admin": bool(row.admin), "weight": row.weight}


@click.group()
def apikey() -> None:
    """Create, list and revoke API keys for `batchinfer api`."""


@apikey.command("create")
@click.option("--name", required=True, help="A label for the key (also its owner unless --owner is given).")
@click.option("--owner", default=None, help="The owner whose files and batches the key sees (default: NAME). "
              "Give several keys the same owner to rotate them.")
@click.option("--admin", is_flag=True, help="An operator's key: its dashboard shows every owner's batches "
              "(CLI and schedule jobs, owner 'local', included) and may open, cancel and download them.")
@click.option("--weight", type=float, default=1.0, show_default=True,
              help="The owner's fair share of the workers: an owner with weight 2 is served twice the tokens "
              "of an owner with weight 1 while both wait (its keys' highest weight counts).")
@json_option("Print the key and its fields as one JSON object (the key is in it: store it now).")
def create(name: str, owner: str | None, admin: bool, weight: float, as_json: bool) -> None:
    """Create a key and print it once: it is stored hashed and cannot be shown again."""
    from batchinfer.store.apikeys import create_key

    with _session() as session:
        try:
            plaintext, row = create_key(session, name=name, owner=owner, admin=admin, weight=weight)
        except ValueError as exc:
            fail(f"{'--weight' if 'weight' in str(exc) else '--name/--owner'}: {exc}")
        info = _key_object(row)
    emit({"key": plaintext, **info}, plaintext)
    if not as_json:
        role = ", admin: its dashboard sees every owner" if admin else ""
        click.echo(f"(key id {info['id']}, owner {info['owner']!r}{role}; store it now: it will not be shown "
                   "again)", err=True)


@apikey.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked keys.")
@json_option("One JSON object per key.")
def list_(include_revoked: bool, as_json: bool) -> None:
    """List keys: id, name, owner, fair-share weight, prefix, created, last used, revoked (never the key)."""
    from batchinfer.store.apikeys import list_keys

    with _session() as session:
        keys = [_key_object(row) for row in list_keys(session, include_revoked=include_revoked)]
    if as_json:
        for key in keys:
            emit(key)
        return
    if not keys:
        click.echo("no API keys (create one with `batchinfer apikey create --name NAME`)")
        return

    def when(value: str | None) -> str:
        return value[:19].replace("T", " ") if value else "-"

    header = ("ID", "NAME", "OWNER", "WEIGHT", "PREFIX", "CREATED", "LAST USED", "REVOKED")
    table = [header] + [(str(k["id"]), k["name"] or "", k["owner"] + (" (admin)" if k["admin"] else ""),
                         f"{k['weight']:g}", k["prefix"] + "...",
                         when(k["created_at"]), when(k["last_used_at"]), when(k["revoked_at"])) for k in keys]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


@apikey.command("revoke")
@click.argument("key_id", type=int)
@json_option("Print the revoked key's fields as one JSON object.")
def revoke(key_id: int, as_json: bool) -> None:
    """Revoke the key with id KEY_ID (requests with it get 401 from now on)."""
    from batchinfer.store.apikeys import revoke_key

    with _session() as session:
        row = revoke_key(session, key_id=key_id)
        if row is None:
            fail(f"no API key with id {key_id} (see `batchinfer apikey list --all`)")
        info = _key_object(row)
    emit(info, f"revoked key {info['id']} ({info['name']}, owner {info['owner']!r})")
