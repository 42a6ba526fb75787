"""result bodies by reference: a request row holds a cached body's key or its own copy, never both

From this revision a cacheable success's row keeps no copy of its response: `result_key` names its body
in `result_bodies` and `response` is NULL (store/responses.py renders it; issue 31). Rows written by the
0010-0012 workers kept a copy beside the key; upgrading drops their key (their copy is their output, and a
key would pin the body for nothing). Downgrading writes each referenced body back into its rows, rendered
as the rows would have been exported, since older code reads only `response`.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import orjson
import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 1000  # rows rendered per round trip on downgrade

requests = sa.table("requests", sa.column("id", sa.BigInteger()), sa.column("job_id", sa.BigInteger()),
                    sa.column("endpoint", sa.String()), sa.column("response", sa.Text()),
                    sa.column("result_key", sa.String()),
                    sa.column("finished_at", sa.DateTime(timezone=True)))
result_bodies = sa.table("result_bodies", sa.column("key", sa.String()), sa.column("body", sa.LargeBinary()))
jobs = sa.table("jobs", sa.column("id", sa.BigInteger()), sa.column("model", sa.String()))


def upgrade() -> None:
    op.execute(requests.update().where(requests.c.result_key.is_not(None), requests.c.response.is_not(None))
               .values(result_key=None))


def downgrade() -> None:
    from datetime import UTC

    from batchinfer.store.responses import render_response

    connection = op.get_bind()
    after = -1
    while True:
        rows = connection.execute(
            sa.select(requests.c.id, requests.c.endpoint, requests.c.finished_at, result_bodies.c.body,
                      jobs.c.model)
            .join(result_bodies, result_bodies.c.key == requests.c.result_key)
            .join(jobs, jobs.c.id == requests.c.job_id)
            .where(requests.c.response.is_(None), requests.c.result_key.is_not(None), requests.c.id > after)
            .order_by(requests.c.id).limit(BATCH)).all()
        if not rows:
            break
        for request_id, endpoint, finished_at, body, model in rows:
            finished = finished_at if finished_at.tzinfo is not None else finished_at.replace(tzinfo=UTC)
            response = render_response(endpoint=endpoint, default_model=model, request_id=request_id,
                                       created=int(finished.timestamp()), result=orjson.loads(body))
            connection.execute(requests.update().where(requests.c.id == request_id)
                               .values(response=orjson.dumps(response).decode(), result_key=None))
        after = rows[-1][0]
