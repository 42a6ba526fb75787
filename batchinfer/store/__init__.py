"""Persistence: SQLAlchemy models and the services around them. Never imports torch or the engine.

db (engines, sessions, SQLite pragmas, migrations), columns (shared column types), models (tables,
status enums and status sets), errors (JobError and its subclasses, LeaseLost), transitions (row locks,
stopping and finishing a job), ingest (JSONL streaming into request rows and shards), jobs (job
service), results (recording worker results), export (output and error lines), shards (leases),
workers (the worker registry), files, apikeys, schedules, serialize (public OpenAI objects), stats
(/metrics figures).
"""
