"""Persistence: SQLAlchemy models and the services around them. Never imports torch or the engine.

db (engines, sessions, SQLite pragmas, migrations), columns (shared column types), ids (the range of
each public id column: beyond it an id is "not found"), models (tables,
status enums and status sets), errors (JobError and its subclasses, LeaseLost), transitions (row locks,
stopping and finishing a job), ingest (JSONL streaming into request rows and shards), jobs (job
service), results (recording worker results), export (output and error lines), shards (leases),
workers (the worker registry), files, apikeys, schedules, serialize (public OpenAI objects), stats
(/metrics figures).
"""

LOCAL_OWNER = "local"
"""The owner of what the local CLI submits and of everything on a server with auth disabled; jobs a
schedule starts belong to the schedule's owner, this one for `batchinfer schedule add`. Defined here,
in the package itself, so the CLI can name it without importing SQLAlchemy."""
