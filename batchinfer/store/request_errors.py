"""A job's failed requests as data: line number, custom_id, code and message (what the dashboard lists).

The error file's lines (store/export.py) carry OpenAI's {code, message} only; a request's line number is
its row's own column (Request.line_number), read here, never parsed back out of the message text.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction
from batchinfer.store.models import REQUEST_NOT_RUN_STATUSES, Request, RequestStatus, request_id_for
from batchinfer.store.transitions import NOT_RUN_ERRORS

FAILED_STATUSES = (RequestStatus.ERRORED, *sorted(REQUEST_NOT_RUN_STATUSES))
"""The requests the error file lists: errored ones and those their job stopped before they ran."""


@dataclass(frozen=True, slots=True)
class RequestError:
    """One failed request: its input line (1-based), custom_id, error code and message as stored."""

    line: int
    custom_id: str | None
    code: str
    message: str

    @property
    def detail(self) -> str:
        """The message without the `line N: ` it starts with (the line is shown from `line`)."""
        return self.message.removeprefix(f"line {self.line}: ")


def request_errors(session: Session, *, job_id: int, limit: int) -> list[RequestError]:
    """The job's first `limit` failed requests (FAILED_STATUSES), in input order (a primary-key range)."""
    statuses = [status.value for status in FAILED_STATUSES]
    rows = session.execute(
        select(Request.line_number, Request.custom_id, Request.status, Request.error_code,
               Request.error_message)
        .where(Request.id > request_id_for(job_id, 0), Request.id < request_id_for(job_id + 1, 0),
               Request.status.in_(statuses))
        .order_by(Request.id).limit(limit)).all()
    end_transaction(session)
    errors = []
    for line, custom_id, status, code, message in rows:
        if code is None:  # not run: the error its status stands for, as the error file writes it
            code, message = NOT_RUN_ERRORS.get(RequestStatus(status), ("unknown_error", "no detail"))
        errors.append(RequestError(line=line, custom_id=custom_id, code=code, message=message or ""))
    return errors
