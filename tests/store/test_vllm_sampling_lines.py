"""vLLM's sampling fields and request options on input lines (issue 18): accepted with vLLM's / OpenAI's
rules, bad values name the field, and the stored params and options survive the requests table."""

from __future__ import annotations

import orjson
import pytest

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.wire.input_line import parse_line
from batchinfer.wire.request import LineError, encode_stored

USER = [{"role": "user", "content": "hi"}]


def _line(body: dict, url: str = "/v1/chat/completions") -> bytes:
    return orjson.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body})


def _error(body: dict, url: str = "/v1/chat/completions") -> LineError:
    with pytest.raises(LineError) as caught:
        parse_line(_line(body, url), 3)
    return caught.value


def test_new_sampling_fields_are_read_and_survive_the_payload() -> None:
    body = {"messages": USER, "logit_bias": {"17": -100, "5": 2.5}, "bad_words": ["cat", "big dog"],
            "allowed_token_ids": [1, 2, 3], "truncate_prompt_tokens": 8,
            "spaces_between_special_tokens": False}
    request = parse_line(_line(body), 1)
    params = request.params
    assert params.logit_bias == {17: -100.0, 5: 2.5}
    assert params.bad_words == ["cat", "big dog"] and params.allowed_token_ids == [1, 2, 3]
    assert params.truncate_prompt_tokens == 8 and params.spaces_between_special_tokens is False
    stored = orjson.loads(encode_stored(request))  # what the requests table holds
    assert stored["params"]["logit_bias"] == {"17": -100.0, "5": 2.5}
    assert SamplingParams.from_dict(stored["params"]) == params
    assert params.has_logits_controls and not SamplingParams().has_logits_controls
    assert SamplingParams().to_dict() == {}  # defaults stay out of the stored JSON


@pytest.mark.parametrize(("field", "value", "says"), [
    ("logit_bias", {"17": 101}, "body.logit_bias['17']: must be in [-100, 100]; got 101"),
    ("logit_bias", {"cat": 1}, "body.logit_bias: keys must be token ids"),
    ("logit_bias", [1], "body.logit_bias: must be an object of token id -> bias"),
    ("bad_words", "cat", "body.bad_words: must be a list of non-empty strings"),
    ("bad_words", [" "], "body.bad_words: must be a list of non-empty strings"),
    ("allowed_token_ids", [], "body.allowed_token_ids: must be a non-empty list"),
    ("allowed_token_ids", [-1], "body.allowed_token_ids: must be a non-empty list"),
    ("truncate_prompt_tokens", 0, "body.truncate_prompt_tokens: must be >= 1; got 0"),
    ("spaces_between_special_tokens", "no", "body.spaces_between_special_tokens: must be true or false"),
    ("add_generation_prompt", 1, "body.add_generation_prompt: must be true or false; got 1"),
    ("chat_template_kwargs", [], "body.chat_template_kwargs: must be an object of template variables"),
    ("chat_template_kwargs", {"tokenize": True}, "body.chat_template_kwargs.tokenize: is set by batchinfer"),
])  # fmt: skip
def test_bad_values_name_the_field(field: str, value: object, says: str) -> None:
    error = _error({"messages": USER, field: value})
    assert error.message.startswith(says), error.message
    assert error.param is not None and error.param.startswith(f"body.{field}")


def test_request_options_are_stored_beside_the_params() -> None:
    chat = parse_line(_line({"messages": USER, "add_generation_prompt": False,
                             "chat_template_kwargs": {"enable_thinking": False}}), 1)
    assert chat.options == {"add_generation_prompt": False,
                            "chat_template_kwargs": {"enable_thinking": False}}
    assert chat.payload().options == chat.options
    completion = parse_line(_line({"prompt": "x", "echo": True}, "/v1/completions"), 1)
    assert completion.options == {"echo": True}
    plain = parse_line(_line({"prompt": "x", "echo": False}, "/v1/completions"), 1)
    assert plain.options is None
    assert "options" not in orjson.loads(encode_stored(plain))  # defaults are not stored
    assert "echo" in _error({"messages": USER, "echo": True}).message  # echo belongs to completions
    shorthand = parse_line(orjson.dumps({"prompt": "x", "echo": True, "logit_bias": {"3": 1}}), 4)
    assert shorthand.options == {"echo": True} and shorthand.params.logit_bias == {3: 1.0}


def test_prompt_logprobs_is_read_on_both_endpoints_and_bounded() -> None:
    for url, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER})):
        request = parse_line(_line({**body, "prompt_logprobs": 2}, url), 1)
        assert request.params.prompt_logprobs == 2
        stored = orjson.loads(encode_stored(request))
        assert SamplingParams.from_dict(stored["params"]).prompt_logprobs == 2
    error = _error({"prompt": "x", "prompt_logprobs": 50}, "/v1/completions")
    assert error.param == "body.prompt_logprobs" and "<= 20" in error.message
    assert "must be an integer" in _error({"prompt": "x", "prompt_logprobs": True}, "/v1/completions").message
