"""Per-request resource budget at ingest (issue 15): products of fields, the stop list, the KV capacity."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from batchinfer.config import Settings
from batchinfer.store.models import JobStatus
from batchinfer.wire.budget import DEFAULT_KV_TOKENS, RequestBudget, model_shape
from batchinfer.wire.input_line import parse_line
from batchinfer.wire.request import LineError
from tests.store.helpers import chat_line, jsonl, submit_job

# The line of the issue: 160 bytes that made a worker allocate ~1.1 GB and write an 84 MB result line.
ATTACK = chat_line("greedy", "hi", n=128, logprobs=True, top_logprobs=20, max_tokens=480, ignore_eos=True)


def _request(**fields):
    return parse_line(chat_line("x", "hello there", **fields), 1)


def _model_dir(tmp_path: Path, **config) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_logprobs_product_is_refused_naming_the_setting() -> None:
    budget = RequestBudget.from_settings(Settings(max_request_kv_tokens=1 << 20), "no-such-model")
    with pytest.raises(LineError) as caught:
        budget.check(parse_line(ATTACK, 1))
    assert caught.value.code == "request_too_large" and caught.value.param == "logprobs"
    assert "1290240 logprob entries" in caught.value.message
    assert "max_request_logprobs" in caught.value.message
    budget.check(_request(n=2, logprobs=True, top_logprobs=5, max_tokens=100))  # 1,200 entries: fine


def test_prompt_logprobs_product_is_refused_naming_the_field() -> None:
    budget = RequestBudget.from_settings(Settings(max_request_kv_tokens=1 << 22, max_request_logprobs=1000),
                                         "no-such-model")
    long_prompt = parse_line(chat_line("x", "word " * 2000, prompt_logprobs=20, max_tokens=1), 1)
    with pytest.raises(LineError) as caught:
        budget.check(long_prompt)
    assert caught.value.param == "prompt_logprobs" and "max_request_logprobs" in caught.value.message
    budget.check(_request(prompt_logprobs=20, max_tokens=1))  # a short prompt: a few hundred entries


def test_kv_product_is_refused_against_the_models_cache(tmp_path: Path) -> None:
    # 2 x 4 layers x 2 kv heads x 16 dims = 256 values a token, float32: 1 MiB holds 1,024 tokens.
    model = _model_dir(tmp_path, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       hidden_size=64, max_position_embeddings=512)
    assert model_shape(str(model)).kv_values_per_token == 256
    budget = RequestBudget.from_settings(Settings(kv_cache_memory_bytes=1 << 20), str(model))
    assert budget.max_kv_tokens == 1024
    budget.check(_request(n=4, max_tokens=200))  # 4 x ~203 tokens
    with pytest.raises(LineError, match=r"n \(8\) x .* exceeds the KV cache a request may use, 1024 tokens "
                                        r"\(the KV cache of kv_cache_memory_bytes=1048576"):
        budget.check(_request(n=8, max_tokens=200))
    # No max_tokens: the whole context counts (512 tokens each), so n=3 no longer fits.
    budget.check(_request(n=2))
    with pytest.raises(LineError, match="no max_tokens: the whole context"):
        budget.check(_request(n=3))


def test_kv_capacity_defaults_and_setting() -> None:
    assert RequestBudget.from_settings(Settings(), "not-here").max_kv_tokens == DEFAULT_KV_TOKENS
    budget = RequestBudget.from_settings(Settings(max_request_kv_tokens=100), "not-here")
    with pytest.raises(LineError, match=r"max_request_kv_tokens\)"):
        budget.check(parse_line(orjson.dumps({"prompt": list(range(90)), "max_tokens": 20}), 1))


def test_stop_list_length_is_bounded() -> None:
    budget = RequestBudget.from_settings(Settings(), "not-here")
    budget.check(_request(stop=[f"s{i}" for i in range(16)]))
    with pytest.raises(LineError, match=r"30000 stop strings; at most 16 are allowed \(max_stop_sequences\)"):
        budget.check(_request(stop=[f"s{i}" for i in range(30_000)]))


def test_submit_errors_the_line_and_runs_the_rest(session) -> None:
    stops = chat_line("stops", "hi", stop=[f"stop-{i}" for i in range(30_000)], max_tokens=4)
    job = submit_job(session, stream=jsonl(chat_line("ok", "hi", max_tokens=8), ATTACK, stops), model="m")
    assert job.status == JobStatus.IN_PROGRESS
    assert job.request_counts == {"total": 3, "completed": 0, "failed": 2}
    by_line = {error["line"]: error for error in job.errors}
    assert by_line[2]["code"] == "request_too_large" and by_line[2]["message"].startswith("line 2: n (128)")
    assert "max_stop_sequences" in by_line[3]["message"]
