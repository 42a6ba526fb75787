"""batchinfer.formats: input normalization to vLLM params, and the output/error line builders."""

from __future__ import annotations

import orjson
import pytest

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.formats import (
    BatchOutputLine,
    Endpoint,
    LineError,
    error_line,
    normalize_body,
    output_line,
    parse_line,
    response_body,
)


def line(obj: object) -> bytes:
    return orjson.dumps(obj)


def test_openai_chat_line_maps_sampling_fields_to_vllm_names():
    request = parse_line(line({"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "gpt-4o-mini", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                          {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["\n\n"], "seed": 3,
        "presence_penalty": 0.1, "frequency_penalty": -0.2, "logprobs": True, "top_logprobs": 4,
        "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [7],
        "ignore_eos": False, "skip_special_tokens": True}}), 1)
    assert request.custom_id == "q1" and request.endpoint is Endpoint.CHAT
    assert request.messages[1] == {"role": "user", "content": "Hi\nthere"}  # text parts joined
    assert request.params == {
        "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["\n\n"], "seed": 3,
        "presence_penalty": 0.1, "frequency_penalty": -0.2, "logprobs": 4, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [7], "ignore_eos": False,
        "skip_special_tokens": True}
    SamplingParams(**request.params)  # the worker builds exactly this


def test_completions_logprobs_is_a_count_and_missing_max_tokens_means_no_limit():
    request = normalize_body("/v1/completions", {"prompt": "Once upon a time", "logprobs": 2})
    assert request.endpoint is Endpoint.COMPLETIONS and request.prompt == "Once upon a time"
    assert request.params == {"logprobs": 2, "max_tokens": None}
    assert normalize_body("/v1/completions", {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]


def test_shorthand_lines_get_line_number_ids_and_may_name_their_own():
    chat = parse_line(b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}', 7)
    assert (chat.custom_id, chat.endpoint, chat.params["max_tokens"]) == ("line-7", Endpoint.CHAT, 5)
    text = parse_line(b'{"prompt": "2+2=", "temperature": 0}', 9)
    assert (text.custom_id, text.endpoint) == ("line-9", Endpoint.COMPLETIONS)
    named = parse_line(b'{"custom_id": "mine", "prompt": "x"}', 3)
    assert named.custom_id == "mine" and named.payload() == {"prompt": "x", "params": {"max_tokens": None}}


def test_cached_option_validation_keeps_int_float_and_bool_apart():
    ok = normalize_body("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "ignore_eos": True})
    assert ok.params["ignore_eos"] is True
    with pytest.raises(LineError, match="ignore_eos"):  # 1 hashes like True but is not a boolean
        normalize_body("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "ignore_eos": 1})


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}, "body.max_tokens", ">= 1"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": 2.5}, "body.temperature", "between 0 and 2"),
    ({"messages": [{"role": "user", "content": "a"}], "temprature": 1}, "body.temprature", "unknown"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": 3}, "body.logprobs", "true or false"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, "body.top_logprobs", "logprobs: true"),
    ({"messages": [], "n": 1}, "body.messages", "non-empty"),
    ({"prompt": "x"}, "body.prompt", "/v1/completions"),
])
def test_body_errors_name_the_field(body, param, fragment):
    with pytest.raises(LineError) as info:
        normalize_body("/v1/chat/completions", body, custom_id="c1")
    assert info.value.param == param and fragment in info.value.message
    assert info.value.custom_id == "c1"


def test_output_and_error_lines_have_the_openai_shape():
    body = response_body(endpoint="chat", model="m", request_key=5, created=1700000000,
                         choices=[{"text": "Paris", "finish_reason": "stop"}], prompt_tokens=12,
                         completion_tokens=2, cached_tokens=8)
    ok = BatchOutputLine.model_validate(output_line(request_key=5, custom_id="q", body=body))
    assert ok.response.body.object == "chat.completion" and ok.error is None
    assert ok.response.body.choices[0]["message"] == {"role": "assistant", "content": "Paris"}
    assert ok.response.body.usage.total_tokens == 14 and ok.response.body.usage.prompt_tokens_details.cached_tokens == 8
    text = response_body(endpoint="completions", model="m", request_key=6, created=0,
                         choices=[{"text": " four", "finish_reason": "length"}], prompt_tokens=3,
                         completion_tokens=1, cached_tokens=0)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == " four"
    fragment = orjson.Fragment(orjson.dumps(body))  # export splices the stored JSON
    assert orjson.loads(orjson.dumps(output_line(request_key=5, custom_id="q", body=fragment))) == \
        orjson.loads(orjson.dumps(output_line(request_key=5, custom_id="q", body=body)))
    err = BatchOutputLine.model_validate(error_line(request_key=7, custom_id="r", code="worker_lost", message="m"))
    assert err.response is None and err.error.code == "worker_lost"
