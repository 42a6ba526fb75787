"""Helpers for store tests: input lines and fake-but-real worker results."""

from __future__ import annotations

import io

import orjson

from batchinfer.config import Settings
from batchinfer.store import jobs

SETTINGS = Settings()  # what the store functions are given: the defaults of a fresh install


def submit_job(session, **kwargs):
    """jobs.submit_job with SETTINGS."""
    return jobs.submit_job(session, settings=SETTINGS, **kwargs)


def chat_line(custom_id: str, user: str, *, system: str = "You are a helpful assistant.",
              **sampling) -> bytes:
    """An OpenAI batch chat line."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            **sampling}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": body})


def jsonl(*lines: bytes) -> io.BytesIO:
    """A binary stream of the lines, newline-terminated."""
    return io.BytesIO(b"".join(line + b"\n" for line in lines))


def fake_results(pending: list) -> list[dict]:
    """Results a worker could have produced: text derived from the custom_id, tokens from the request."""
    out = []
    for request in pending:
        prompt_tokens = 10 + request.line_number % 7
        out.append({"request_id": request.request_id,
                    "choices": [{"text": f"answer to {request.custom_id}", "finish_reason": "stop"}],
                    "prompt_tokens": prompt_tokens, "completion_tokens": 3,
                    "cached_tokens": prompt_tokens // 2})
    return out
