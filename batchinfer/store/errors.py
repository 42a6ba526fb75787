"""The store's errors: one base, so a caller that only reports can catch JobError alone.

A route or CLI command that answers differently (404 / 409 / 400) catches the subclasses first.
"""

from __future__ import annotations


class JobError(ValueError):
    """A job operation that cannot be done: an invalid argument, or one of the subclasses below."""


class JobNotFound(JobError):
    """No such job (or it belongs to another owner, which callers must not be able to tell apart)."""


class JobStateError(JobError):
    """The job exists but its status does not allow the operation (e.g. cancelling a completed job)."""

    def __init__(self, message: str, *, status: str) -> None:
        super().__init__(message)
        self.status = status  # the job's status when the operation was refused


class LeaseLost(RuntimeError):
    """The shard's lease token no longer matches: another worker (or the rescuer) owns the shard now."""
