"""Hypothesis fuzz of the line parser (issue 15): whatever the bytes, parse_line (and the request budget)
answers a NormalizedRequest or a clean LineError with a code and a message, never another exception."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.config import Settings
from batchinfer.wire.budget import RequestBudget
from batchinfer.wire.input_line import CHAT_FIELDS, COMPLETION_FIELDS, ENVELOPE_FIELDS, parse_line
from batchinfer.wire.request import LineError, NormalizedRequest, encode_stored


def _dumps(value: object) -> bytes:
    """JSON text of any generated value (big integers and NaN included, which orjson refuses to write)."""
    return json.dumps(value).encode()



BUDGET = RequestBudget.from_settings(Settings(), "not-a-local-model")
# Output constraints are left out of the property until the xfail below is fixed (structured output).
GRAMMAR_FIELDS = {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format",
                  "structured_outputs"}
BODY_KEYS = sorted((CHAT_FIELDS | COMPLETION_FIELDS) - GRAMMAR_FIELDS)
KEYS = sorted(set(BODY_KEYS) | ENVELOPE_FIELDS | {"role", "content", "type", "text"})
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.sampled_from(["/v1/chat/completions", "/v1/completions", "POST", "user", "system", "\x00"]))
JSON = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), children, max_size=6),
                    max_leaves=25)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "bot"]),
                                           "content": JSON}), max_size=3)
BODY = st.dictionaries(st.sampled_from(BODY_KEYS), JSON, max_size=8)
LINES = st.one_of(
    st.binary(max_size=200),
    JSON.map(_dumps),
    st.builds(lambda body, messages: _dumps({**body, "messages": messages}), BODY, MESSAGES),
    st.builds(lambda custom_id, url, body: _dumps({"custom_id": custom_id, "method": "POST", "url": url,
                                                         "body": body}),
              JSON, st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x"]), BODY),
)


def _check(line: bytes) -> None:
    try:
        request = parse_line(line, 7)
        BUDGET.check(request)
    except LineError as exc:
        assert exc.code and exc.message, exc
        return
    assert isinstance(request, NormalizedRequest)
    encode_stored(request)  # what ingest stores must serialize
    request.prefix_text()


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=LINES)
def test_parse_line_answers_only_clean_line_errors(line: bytes) -> None:
    _check(line)


def test_known_nasty_lines() -> None:
    for line in [b"", b"\xff\xfe", b"[]", b"null", b'{"messages": []}', b'{"prompt": [1e400]}',
                 b'{"prompt": "x", "n": 1e400}', b'{"prompt": "x", "max_tokens": 99999999999999999999999}',
                 b'{"prompt": "x", "stop": [null]}',
                 b'{"prompt": "x", "logprobs": 1, "n": 128, "max_tokens": 4096}',
                 b'{"custom_id": {"a": 1}, "method": "POST", "url": "/v1/completions", '
                 b'"body": {"prompt": "x"}}']:
        _check(line)


def test_a_bad_non_ascii_grammar_is_a_line_error() -> None:
    _check(b'{"prompt": "x", "guided_grammar": "\xc3\xa9"}')
