"""`batchinfer purge`: delete expired files and finished jobs past their retention, now (store.retention).

The same pass runs periodically under `batchinfer beat` and `batchinfer scheduler` (workers.duties).
"""

from __future__ import annotations

import click

from batchinfer.cli.output import emit, json_option
from batchinfer.config import get_settings


@click.command()
@json_option("Print {files, jobs} (the deleted ids) as one JSON object.")
def purge(as_json: bool) -> None:
    """Delete uploads past their expires_after and finished batches past their retention
    (output_expires_after, else the finished_job_retention_seconds setting)."""
    from batchinfer.cli.backend import LocalBackend
    from batchinfer.store.retention import purge as purge_expired

    backend = LocalBackend(get_settings())
    with backend.sessions() as session:
        report = purge_expired(session, settings=backend.settings)
    emit({"files": [f"file-{i}" for i in report.files], "jobs": [f"batch_{i}" for i in report.jobs]},
         f"purged {len(report.files)} file(s) and {len(report.jobs)} batch(es)")
