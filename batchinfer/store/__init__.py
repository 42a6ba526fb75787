"""Persistence: SQLAlchemy models and the services around them. Never imports torch or the engine.

db (engines, sessions, SQLite pragmas, migrations), models (tables and status enums), ingest (JSONL
streaming into request rows and shards), jobs (job service), shards (leases and the worker registry).
"""
