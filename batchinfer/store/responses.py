"""A request row's response: its own body, or the result-cache body it references, rendered for it.

A cacheable success's row keeps no copy of its body (store/result_cache.py): `request_response` renders the
referenced `result_bodies` body with the row's own id, created time (its `finished_at`, the second its
result was written) and the job's model as fallback. results.py renders a row's own copy with the same
`render_response`, so a line reads the same whichever way its row holds it. Export (and through it the
CLI's `results`, the REST output file, the dashboard and result-file sizes) reads rows only through here.
"""

from __future__ import annotations

from datetime import datetime

import orjson

from batchinfer.wire.output_line import response_body
from batchinfer.wire.result_row import RowBody


def render_response(*, endpoint: str | None, default_model: str, request_id: int, created: int,
                    result: RowBody) -> dict[str, object]:
    """The response body of a worker's result row (choices, token counts, model: workers/result_rows.py)
    for request `request_id`, answered at `created` (unix seconds)."""
    return response_body(endpoint=endpoint or "", model=result.get("model") or default_model,
                         request_key=request_id, created=created, choices=result.get("choices", []),
                         embeddings=result.get("embeddings"), prompt_logprobs=result.get("prompt_logprobs"),
                         prompt_tokens=result["prompt_tokens"], completion_tokens=result["completion_tokens"],
                         cached_tokens=result["cached_tokens"])


def request_response(*, request_id: int, endpoint: str | None, finished_at: datetime | None,
                     response: str | None, cached_body: bytes | None, default_model: str) -> str | bytes:
    """A succeeded row's response JSON: its own `response`, else its referenced body (`cached_body`, the
    `result_bodies` row of its `result_key`) rendered for this row. ValueError when it has neither."""
    if response is not None:
        return response
    if cached_body is None or finished_at is None:
        raise ValueError(f"request {request_id}: succeeded without a response")
    body = render_response(endpoint=endpoint, default_model=default_model, request_id=request_id,
                           created=int(finished_at.timestamp()), result=orjson.loads(cached_body))
    return orjson.dumps(body)
