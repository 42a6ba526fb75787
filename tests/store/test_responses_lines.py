"""/v1/responses lines (issue 18): text-only input runs as chat; everything else says "not supported by
batchinfer" naming the field; the body is OpenAI's Response object."""

from __future__ import annotations

import orjson
import pytest

from batchinfer.wire.input_line import parse_line
from batchinfer.wire.output_line import output_line, read_output_line, response_body
from batchinfer.wire.request import Endpoint, LineError


def _line(body: dict) -> bytes:
    return orjson.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/responses", "body": body})


def _error(body: dict) -> LineError:
    with pytest.raises(LineError) as caught:
        parse_line(_line(body), 5)
    return caught.value


def test_string_input_instructions_and_max_output_tokens_run_as_chat() -> None:
    request = parse_line(_line({"model": "m", "input": "Say hi", "instructions": "Be brief.",
                                "max_output_tokens": 12, "temperature": 0}), 1)
    assert request.endpoint is Endpoint.RESPONSES
    assert request.messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Say hi"}]
    assert request.params.max_tokens == 12 and request.params.temperature == 0


def test_message_items_with_text_parts() -> None:
    request = parse_line(_line({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"role": "user", "content": "d"}]}), 1)
    assert request.messages == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"},
                                {"role": "user", "content": "d"}]


@pytest.mark.parametrize(("body", "says"), [
    ({"input": "x", "tools": [{"type": "web_search"}]},
     "body.tools: tool calling is not supported by batchinfer on /v1/responses"),
    ({"input": "x", "previous_response_id": "resp_1"}, "body.previous_response_id: conversation state"),
    ({"input": "x", "reasoning": {"effort": "low"}},
     "body.reasoning: reasoning is not supported by batchinfer"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "body.input[0].content[0]: input_image is not supported by batchinfer"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "body.input[0]: function_call_output items are not supported by batchinfer"),
    ({"input": "x", "max_output_tokens": 0}, "body.max_output_tokens: must be an integer >= 1, got 0"),
    ({"instructions": "x"}, "body.input: missing"),
    ({"input": "x", "temprature": 1}, "body.temprature: unknown or unsupported field on /v1/responses"),
])  # fmt: skip
def test_other_responses_features_are_refused_by_name(body: dict, says: str) -> None:
    assert _error(body).message.startswith(says), _error(body).message


def test_the_output_body_is_a_response_object() -> None:
    body = response_body(endpoint="responses", model="m", request_key=7, created=100,
                         choices=[{"text": "hello", "finish_reason": "length", "logprobs": None}],
                         prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["output"][0]["status"] == "incomplete"  # the message item says what the response says
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": "hello", "annotations": []}
    assert body["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 8}
    read_output_line(output_line(request_key=7, custom_id="r1", body=body))
    done = response_body(endpoint="responses", model="m", request_key=8, created=100,
                         choices=[{"text": "hi", "finish_reason": "stop", "logprobs": None}],
                         prompt_tokens=5, completion_tokens=1, cached_tokens=0)
    assert done["status"] == done["output"][0]["status"] == "completed" and done["incomplete_details"] is None
