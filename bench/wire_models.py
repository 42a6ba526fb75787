"""Benchmark: the wire models' cost on the ingest and export paths, plain dicts vs msgspec vs pydantic.

    .venv/bin/python bench/wire_models.py --lines 50000

Why batchinfer/wire/ uses msgspec (issue #30): for each path it times, per line, in CPU microseconds
(best of --repeats), the dicts batchinfer built before wire/ and the same shape as a msgspec Struct and
as a pydantic model:

- ingest, stored payload: the requests table's payload of a parsed line, encoded to JSON text;
- ingest, input line: the envelope {custom_id, method, url, body} as a model, from the parsed JSON
  (after parse_line's checks) and decoded straight from the bytes;
- export, output line: one output line around a stored response body (spliced as stored by orjson's
  Fragment and msgspec's Raw; pydantic has no raw passthrough, so it parses the body).

The lines are bench/ingest.py's (chat and completion requests, ~330 bytes). A ratio, not a throughput:
run it alone (never beside another benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from ingest import generate  # noqa: E402

from batchinfer.wire.input_line import parse_line  # noqa: E402
from batchinfer.wire.output_line import encode_line, output_line  # noqa: E402
from batchinfer.wire.request import NormalizedRequest, encode_stored  # noqa: E402

# The shapes written the other two ways (wire/ holds the msgspec ones used; these mirror them).


class StoredPydantic(BaseModel):
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    params: dict[str, Any]
    options: dict[str, Any] | None = None


class InputStruct(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class InputPydantic(BaseModel):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class ResponsePydantic(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputPydantic(BaseModel):
    id: str
    custom_id: str
    response: ResponsePydantic | None
    error: dict[str, Any] | None
    provenance: dict[str, Any] | None = None


BODY = orjson.dumps({"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "bench",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "An answer."},
                                  "logprobs": None, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48,
                               "prompt_tokens_details": {"cached_tokens": 32}}})
PROVENANCE = b'{"engine":"batchinfer","model_fingerprint":"f","result_cache":"miss"}'


def dict_payload(request: NormalizedRequest) -> str:
    """The stored payload as batchinfer wrote it before wire/: a dict, orjson."""
    out: dict[str, Any] = ({"prompt": request.prompt} if request.messages is None
                           else {"messages": request.messages})
    out["params"] = request.params.to_dict()
    if request.options:
        out["options"] = request.options
    return orjson.dumps(out).decode()


def pydantic_payload(request: NormalizedRequest) -> str:
    return StoredPydantic.model_construct(messages=request.messages, prompt=request.prompt,
                                          params=request.params.to_dict(),
                                          options=request.options).model_dump_json(exclude_none=True)


def dict_output_line(key: int) -> bytes:
    """An output line as export wrote it before wire/: a dict with orjson Fragments."""
    line = {"id": f"batch_req_{key}", "custom_id": "c", "error": None,
            "response": {"status_code": 200, "request_id": f"req_{key}", "body": orjson.Fragment(BODY)},
            "provenance": orjson.Fragment(PROVENANCE)}
    return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def pydantic_output_line(key: int) -> bytes:
    response = ResponsePydantic.model_construct(status_code=200, request_id=f"req_{key}",
                                                body=orjson.loads(BODY))
    line = OutputPydantic.model_construct(id=f"batch_req_{key}", custom_id="c", response=response, error=None,
                                          provenance=orjson.loads(PROVENANCE))
    return line.model_dump_json().encode() + b"\n"


def per_line_us(work: Callable[[], object], count: int, repeats: int) -> float:
    """Best CPU time of `work` over `repeats` runs, in microseconds per line."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best * 1e6 / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lines.jsonl"
        generate(path, args.lines)
        lines = path.read_bytes().splitlines()
    requests = [parse_line(line, number) for number, line in enumerate(lines, 1)]
    objects = [orjson.loads(line) for line in lines]
    assert all(orjson.loads(dict_payload(r)) == orjson.loads(encode_stored(r)) for r in requests[:100])
    assert orjson.loads(dict_output_line(1)) == orjson.loads(
        encode_line(output_line(request_key=1, custom_id="c", body=BODY, provenance=PROVENANCE)))
    n, repeats = len(lines), args.repeats
    rows = [
        ("ingest: parse_line (the rest of the line's work)", "", lambda: [parse_line(x, 1) for x in lines]),
        ("ingest: stored payload", "dicts + orjson", lambda: [dict_payload(r) for r in requests]),
        ("", "msgspec (wire: encode_stored)", lambda: [encode_stored(r) for r in requests]),
        ("", "pydantic construct + dump_json", lambda: [pydantic_payload(r) for r in requests]),
        ("ingest: input line model", "msgspec Struct from the checked dict",
         lambda: [InputStruct(o["custom_id"], o["method"], o["url"], o["body"]) for o in objects]),
        ("", "pydantic model_construct",
         lambda: [InputPydantic.model_construct(custom_id=o["custom_id"], method=o["method"], url=o["url"],
                                                body=o["body"]) for o in objects]),
        ("", "msgspec decode(bytes, type=)",
         lambda: [msgspec.json.decode(x, type=InputStruct) for x in lines]),
        ("", "pydantic model_validate_json", lambda: [InputPydantic.model_validate_json(x) for x in lines]),
        ("", "(orjson.loads alone, for scale)", lambda: [orjson.loads(x) for x in lines]),
        ("export: output line", "dicts + orjson.Fragment", lambda: [dict_output_line(k) for k in range(n)]),
        ("", "msgspec (wire: encode_line, Raw body)",
         lambda: [encode_line(output_line(request_key=k, custom_id="c", body=BODY, provenance=PROVENANCE))
                  for k in range(n)]),
        ("", "pydantic construct (body parsed) + dump_json",
         lambda: [pydantic_output_line(k) for k in range(n)]),
    ]
    print(f"{n:,} lines, best of {repeats}, CPU us per line; cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.1f}")
    for path_name, way, work in rows:
        print(f"{path_name:<50} {way:<46} {per_line_us(work, n, repeats):7.2f}")


if __name__ == "__main__":
    main()
