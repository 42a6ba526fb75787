"""wire.input_line and wire.output_line: input lines to SamplingParams, schedule defaults, output lines."""

from __future__ import annotations

from dataclasses import fields

import orjson
import pytest

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.wire.input_line import SAMPLING_FIELDS, check_sampling_fields, parse_line
from batchinfer.wire.output_line import (
    ChatCompletion,
    encode_line,
    error_line,
    output_line,
    read_output_line,
    response_body,
)
from batchinfer.wire.request import Endpoint, LineError, encode_stored

USER = [{"role": "user", "content": "a"}]


def line(obj: object) -> bytes:
    return orjson.dumps(obj)


def envelope(url: str, body: object, custom_id: str = "c1") -> bytes:
    return line({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_openai_chat_line_maps_sampling_fields_to_vllm_names():
    request = parse_line(envelope("/v1/chat/completions", {
        "model": "gpt-4o-mini",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                  {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["\n\n"], "seed": 3,
        "presence_penalty": 0.1, "frequency_penalty": -0.2, "logprobs": True, "top_logprobs": 4,
        "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [7],
        "ignore_eos": False, "skip_special_tokens": True}, custom_id="q1"), 1)
    assert request.custom_id == "q1" and request.endpoint is Endpoint.CHAT
    assert request.messages[1] == {"role": "user", "content": "Hi\nthere"}  # text parts joined
    assert request.params == SamplingParams(
        max_tokens=20, temperature=0.5, top_p=0.9, n=2, stop=["\n\n"], seed=3, presence_penalty=0.1,
        frequency_penalty=-0.2, logprobs=4, top_k=40, min_p=0.05, repetition_penalty=1.1, min_tokens=2,
        stop_token_ids=[7], ignore_eos=False, skip_special_tokens=True)
    # What the requests table stores: vLLM names, only what differs from SamplingParams' defaults.
    assert request.payload().params == {
        "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["\n\n"], "seed": 3,
        "presence_penalty": 0.1, "frequency_penalty": -0.2, "logprobs": 4, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [7]}
    assert SamplingParams.from_dict(request.payload().params) == request.params  # what the worker runs


def test_completions_logprobs_is_a_count_and_missing_max_tokens_means_no_limit():
    request = parse_line(envelope("/v1/completions", {"prompt": "Once upon a time", "logprobs": 2}), 1)
    assert request.endpoint is Endpoint.COMPLETIONS and request.prompt == "Once upon a time"
    assert request.params == SamplingParams(logprobs=2, max_tokens=None)
    assert request.payload().params == {"logprobs": 2, "max_tokens": None}
    assert parse_line(envelope("/v1/completions", {"prompt": [1, 2, 3]}), 1).prompt == [1, 2, 3]


def test_shorthand_lines_get_line_number_ids_and_may_name_their_own():
    chat = parse_line(b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}', 7)
    assert (chat.custom_id, chat.endpoint, chat.params.max_tokens) == ("line-7", Endpoint.CHAT, 5)
    text = parse_line(b'{"prompt": "2+2=", "temperature": 0}', 9)
    assert (text.custom_id, text.endpoint) == ("line-9", Endpoint.COMPLETIONS)
    named = parse_line(b'{"custom_id": "mine", "prompt": "x"}', 3)
    assert named.custom_id == "mine"
    assert orjson.loads(encode_stored(named)) == {"prompt": "x", "params": {"max_tokens": None}}


def test_cached_option_validation_keeps_int_float_and_bool_apart():
    ok = parse_line(envelope("/v1/chat/completions", {"messages": USER, "ignore_eos": True}), 1)
    assert ok.params.ignore_eos is True
    with pytest.raises(LineError, match="ignore_eos"):  # 1 hashes like True but is not a boolean
        parse_line(envelope("/v1/chat/completions", {"messages": USER, "ignore_eos": 1}), 1)


def test_one_sampling_params_is_built_per_distinct_set_of_fields(monkeypatch):
    built = []
    validate = SamplingParams.__post_init__
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: (built.append(1), validate(self)))
    bodies = [{"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 7, "seed": 90_001}
              for i in range(5)]
    requests = [parse_line(envelope("/v1/chat/completions", body, f"r{i}"), i)
                for i, body in enumerate(bodies)]
    assert len(built) == 1 and all(r.params is requests[0].params for r in requests)  # shared, frozen
    parse_line(envelope("/v1/chat/completions", {**bodies[0], "seed": 90_002}), 9)
    assert len(built) == 2


def test_line_sampling_fields_are_the_sampling_params_fields():
    # Every field parse_line passes to SamplingParams exists there (so no TypeError can hide behind it).
    assert SAMPLING_FIELDS | {"logprobs"} == {f.name for f in fields(SamplingParams)}


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"messages": USER, "max_tokens": -1}, "body.max_tokens", ">= 1"),
    ({"messages": USER, "temperature": 2.5}, "body.temperature", "between 0 and 2"),
    ({"messages": USER, "temprature": 1}, "body.temprature", "unknown"),
    ({"messages": USER, "logprobs": 3}, "body.logprobs", "true or false"),
    ({"messages": USER, "top_logprobs": 3}, "body.top_logprobs", "logprobs: true"),
    ({"messages": [], "n": 1}, "body.messages", "non-empty"),
    ({"prompt": "x"}, "body.prompt", "/v1/completions"),
])
def test_body_errors_name_the_field(body, param, fragment):
    with pytest.raises(LineError) as info:
        parse_line(envelope("/v1/chat/completions", body), 1)
    assert info.value.param == param and fragment in info.value.message
    assert info.value.custom_id == "c1"


def test_sampling_value_errors_carry_field_and_message_of_sampling_params():
    with pytest.raises(LineError) as info:
        parse_line(envelope("/v1/chat/completions", {"messages": USER, "top_p": 0}), 1)
    assert (info.value.code, info.value.param) == ("invalid_value", "body.top_p")
    assert info.value.message == "body.top_p: must be in (0, 1]; got 0"


@pytest.mark.parametrize("defaults", [
    {"max_tokens": 8, "temperature": 0},
    {"max_completion_tokens": 48, "stop": "\n"},
    {"logprobs": 2},  # a completions count
    {"logprobs": True, "top_logprobs": 3},  # chat's form
])
def test_schedule_defaults_accepted_as_lines_accept_them(defaults):
    check_sampling_fields(defaults)


@pytest.mark.parametrize(("defaults", "param", "fragment"), [
    ({"temperature": -1}, "temperature", "must be >= 0"),
    ({"temperature": 3}, "temperature", "between 0 and 2"),
    ({"max_completion_tokens": 0}, "max_tokens", ">= 1"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ({"messages": USER}, "messages", "not a sampling field"),
    ({"model": "other"}, "model", "not a sampling field"),
])
def test_schedule_defaults_refused_with_the_line_error(defaults, param, fragment):
    with pytest.raises(LineError) as info:
        check_sampling_fields(defaults)
    assert info.value.param == param and fragment in info.value.message


def test_output_and_error_lines_have_the_openai_shape():
    body = response_body(endpoint="chat", model="m", request_key=5, created=1700000000,
                         choices=[{"text": "Paris", "finish_reason": "stop"}], prompt_tokens=12,
                         completion_tokens=2, cached_tokens=8)
    ok = read_output_line(output_line(request_key=5, custom_id="q", body=body))
    assert isinstance(ok.response.body, ChatCompletion) and ok.error is None  # the tag: "chat.completion"
    assert ok.response.body.choices[0]["message"] == {"role": "assistant", "content": "Paris"}
    assert ok.response.body.usage.total_tokens == 14
    assert ok.response.body.usage.prompt_tokens_details.cached_tokens == 8
    text = response_body(endpoint="completions", model="m", request_key=6, created=0,
                         choices=[{"text": " four", "finish_reason": "length"}], prompt_tokens=3,
                         completion_tokens=1, cached_tokens=0)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == " four"
    stored = orjson.dumps(body)  # export splices the stored JSON as it is
    assert encode_line(output_line(request_key=5, custom_id="q", body=stored)) == \
        encode_line(output_line(request_key=5, custom_id="q", body=body))
    traced = output_line(request_key=5, custom_id="q", body=stored, provenance=b'{"engine": "e"}')
    assert orjson.loads(encode_line(traced))["provenance"] == {"engine": "e"}
    plain = output_line(request_key=5, custom_id="q", body=stored)
    assert "provenance" not in orjson.loads(encode_line(plain))
    err = read_output_line(error_line(request_key=7, custom_id="r", code="worker_lost",
                                                    message="m"))
    assert err.response is None and err.error.code == "worker_lost"
