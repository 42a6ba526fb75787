"""What a known failure says on one line: the problem and the fix, instead of a traceback.

The main group (cli/__init__.py) hands any exception a command lets escape to `describe_failure`; a
failure it knows becomes one `error:` line (or one JSON object under --json) and exit 1, the others keep
their traceback (a bug should show where it is). Known: a model that is not here, a device this process
lacks, a database that is down, missing or never migrated.
"""

from __future__ import annotations

from batchinfer.config import get_settings, mask_url_password

# Phrases of the drivers' messages (psycopg, sqlite3) that tell a missing schema from an outage.
_NO_SCHEMA = ("does not exist", "no such table", "undefinedtable")
_NO_DATABASE = "database"  # psycopg: 'FATAL:  database "x" does not exist'


def describe_failure(exc: BaseException) -> str | None:
    """One line for a failure the user can fix, or None for one that should keep its traceback."""
    from batchinfer.engine.errors import DeviceUnavailableError, ModelNotFoundError

    if isinstance(exc, ModelNotFoundError | DeviceUnavailableError):
        return str(exc)
    return _database_failure(exc)


def _database_failure(exc: BaseException) -> str | None:
    from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

    if not isinstance(exc, DBAPIError):
        return None
    url = mask_url_password(get_settings().effective_database_url)
    detail = " ".join(str(exc.orig).split()) if exc.orig is not None else type(exc).__name__
    lowered = f"{type(exc.orig).__name__} {detail}".lower()
    if isinstance(exc, OperationalError) and "connection" in lowered and _NO_DATABASE in lowered \
            and "does not exist" in lowered:
        return (f"database {url}: {_short(detail)}; create it (createdb), then run `batchinfer db upgrade`, "
                "or set BATCHINFER_DATABASE_URL")
    if isinstance(exc, ProgrammingError | OperationalError) and any(p in lowered for p in _NO_SCHEMA):
        return (f"database {url} has no batchinfer tables (never migrated?): run `batchinfer db upgrade` "
                f"({_short(detail)})")
    if isinstance(exc, OperationalError) and url.startswith("sqlite"):  # a file: nothing to start
        if "locked" in lowered:
            return (f"database {url} is locked by another process's write past the busy timeout "
                    f"({_short(detail)}); retry, or use PostgreSQL for many concurrent writers")
        return (f"database {url} cannot be used ({_short(detail)}); check that its directory exists and is "
                "writable and the disk has room, or set BATCHINFER_DATABASE_URL")
    if isinstance(exc, OperationalError):
        return (f"database {url} is unreachable ({_short(detail)}); start it, or set "
                "BATCHINFER_DATABASE_URL")
    return None


def _short(detail: str, limit: int = 200) -> str:
    """The driver's message, bounded (psycopg's can run to several sentences and the SQL)."""
    detail = detail.split("[SQL:")[0].split(" LINE ")[0].strip()  # not the SQL it ran
    return detail if len(detail) <= limit else detail[: limit - 3] + "..."
