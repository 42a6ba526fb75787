"""Input files and result checks shared by the worker tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson

SYSTEM = "You are a helpful assistant that answers in one short sentence."


def write_requests(path: Path, count: int, *, max_tokens: int = 6, seeded: bool = False,
                   extra_lines: list[bytes] | None = None,
                   body_of: Callable[[int], dict] | None = None) -> list[str]:
    """Write `count` chat requests (shared system prompt) and return their custom_ids in order.

    body_of(i), where given, is merged into request i's body (per-request max_tokens, ignore_eos ...).
    """
    ids = []
    with path.open("wb") as out:
        for i in range(count):
            custom_id = f"req-{i:04d}"
            ids.append(custom_id)
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"the cat reads the prompt number {i}"}],
                    "max_tokens": max_tokens + (i % 3)}
            if seeded:
                body.update({"temperature": 0.8, "seed": 1000 + i})
            if body_of is not None:
                body.update(body_of(i))
            out.write(orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")
        for line in extra_lines or []:
            out.write(line + b"\n")
    return ids


def read_lines(path: Path) -> list[dict]:
    """Parse a JSONL results file."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
