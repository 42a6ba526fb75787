"""The body fields that ask for structured output, read into the request's one output constraint.

- OpenAI, chat only: `response_format` {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
  object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
- vLLM, both endpoints: `guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice`
  (a list of strings), `guided_grammar` (EBNF), and the newer `structured_outputs` object
  ({"json" | "regex" | "choice" | "grammar" | "json_object": ..., "disable_any_whitespace": bool}), which
  SamplingParams reads itself.

A request carries at most one constraint. Errors are SamplingParamsError whose field is the body path the
user wrote (`response_format.json_schema.schema`, `guided_regex`), so input_line.py reports them as it reports
every other sampling field. Pure Python: the grammar check itself runs in StructuredOutputsParams.
"""

from __future__ import annotations

import re
from typing import Any

from batchinfer.engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from batchinfer.wire.json_types import JSONObject, JSONValue

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's field -> StructuredOutputsParams field
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# The body fields read here (input_line.py accepts them on both endpoints; response_format is refused here
# on /v1/completions, with the fields to use instead).
CONSTRAINT_FIELDS = frozenset({*GUIDED_FIELDS, "response_format", "structured_outputs"})
JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


def read_constraint(options: JSONObject, *, chat: bool) -> StructuredOutputsParams | JSONValue:
    """The value of SamplingParams.structured_outputs for a body's fields (None: unconstrained).

    Raises SamplingParamsError naming the body field; the `structured_outputs` object is returned as
    given, for SamplingParams to check. `chat`: the body is a /v1/chat/completions one.
    """
    # (the field the user wrote, its constraint)
    found: list[tuple[str, StructuredOutputsParams | JSONValue]] = []
    if not chat and "response_format" in options:
        raise SamplingParamsError("response_format", "belongs to /v1/chat/completions; here use guided_json, "
                                  "guided_regex, guided_choice, guided_grammar or structured_outputs")
    if options.get("response_format") is not None:
        constraint = _response_format(options["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for name, kind in GUIDED_FIELDS.items():
        if options.get(name) is not None:
            found.append((name, _build(name, **{kind: options[name]})))
    if options.get("structured_outputs") is not None:
        found.append(("structured_outputs", options["structured_outputs"]))
    if len(found) > 1:
        raise SamplingParamsError(found[1][0], f"give one output constraint per request; {found[0][0]} "
                                  f"and {found[1][0]} are both set")
    return found[0][1] if found else None


def _response_format(value: JSONValue) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise SamplingParamsError("response_format", "must be an object such as {\"type\": \"json_object\"}; "
                                  f"got {type(value).__name__}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise SamplingParamsError("response_format.type",
                                  f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")
    extra = sorted(value.keys() - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:
        raise SamplingParamsError(f"response_format.{extra[0]}", f"unknown field for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise SamplingParamsError(where, "missing; type json_schema needs "
                                  "{\"name\": \"...\", \"schema\": {...}}")
    extra = sorted(spec.keys() - JSON_SCHEMA_FIELDS)
    if extra:
        raise SamplingParamsError(f"{where}.{extra[0]}",
                                  f"unknown field; use {', '.join(sorted(JSON_SCHEMA_FIELDS))}")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        got = "it is missing (OpenAI requires it)" if name is None else f"got {name!r:.80}"
        raise SamplingParamsError(f"{where}.name", f"must be 1 to 64 letters, digits, _ or -; {got}")
    if spec.get("strict") not in (None, True, False):
        raise SamplingParamsError(f"{where}.strict", f"must be true or false; got {spec['strict']!r}")
    if not isinstance(spec.get("description", ""), str):
        raise SamplingParamsError(f"{where}.description", "must be a string")
    if "schema" not in spec:
        raise SamplingParamsError(f"{where}.schema", "missing; give the JSON Schema the output must match")
    # strict or not, the output is held to the schema: the grammar enforces it token by token.
    return _build(f"{where}.schema", json=spec["schema"])


def _build(field: str, **constraint: Any) -> StructuredOutputsParams:  # Any: the constructor checks the JSON
    try:
        return StructuredOutputsParams(**constraint)
    except SamplingParamsError as exc:
        raise SamplingParamsError(field, exc.message) from None
