"""Row id ranges: the largest id each public id column can hold, so an id beyond it is simply "not found".

A public id (`batch_<n>`, `file-<n>`) may carry any number a client types. Handed to the database
unchecked, a number past the column's range is an error there (PostgreSQL: `integer out of range`,
SQLite: an int beyond 64 bits), which would surface as a 500. The store's lookups check these bounds
first and answer None / JobNotFound instead, so every route and command answers 404 / "not found".

The bounds are read from the column types, so a migration that widens a column widens them too. A job id
has a second bound: a request's key is job_id << LINE_BITS | line (models.request_id_for), a signed
64-bit integer, so job ids stay below 2**(63 - LINE_BITS) whatever the jobs.id column holds.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ColumnElement

from batchinfer.store.models import LINE_BITS, File, Job

INT32_MAX = 2**31 - 1  # PostgreSQL INTEGER (SQLite's INTEGER PRIMARY KEY is 64-bit, so this is the narrower)
INT64_MAX = 2**63 - 1  # PostgreSQL BIGINT, SQLite INTEGER


def column_max(column: ColumnElement[int]) -> int:
    """The largest value `column` holds on both databases (BIGINT: 64-bit, other integers: 32-bit)."""
    return INT64_MAX if isinstance(column.type, BigInteger) else INT32_MAX


MAX_FILE_ID = column_max(File.__table__.c.id)
MAX_JOB_ID = min(column_max(Job.__table__.c.id), (1 << (63 - LINE_BITS)) - 1)


def is_file_id(value: int) -> bool:
    """True when `value` can be the id of a files row (positive, within the column's range)."""
    return 0 < value <= MAX_FILE_ID


def is_job_id(value: int) -> bool:
    """True when `value` can be the id of a jobs row (positive, within the column's and the key's range)."""
    return 0 < value <= MAX_JOB_ID
