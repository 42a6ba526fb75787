"""`batchinfer estimate` (issue 32): the file read as ingest reads it, prompt tokens from the model's own
tokenizer and chat template, shared prefixes, caps; output and seconds from this deployment's history."""

from __future__ import annotations

import socket
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from batchinfer.cli import main
from tests.workers.helpers import write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", str(tiny_llama))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    return tmp_path


def _estimate(path: Path) -> dict:
    result = CliRunner().invoke(main, ["estimate", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return orjson.loads(result.output)


def test_an_estimate_before_any_history_counts_tokens_exactly_and_states_its_assumption(
        env: Path, tiny_llama: Path) -> None:
    write_requests(env / "in.jsonl", 10, extra_lines=[b'{"custom_id": "bad", "body": 3}'])
    figures = _estimate(env / "in.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    lines = [orjson.loads(line) for line in (env / "in.jsonl").read_bytes().splitlines()[:10]]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(line["body"]["messages"], tokenize=False,
                                                              add_generation_prompt=True),
                                add_special_tokens=False) for line in lines]
    assert figures["requests"] == 10 and figures["invalid_lines"] == 1
    assert figures["errors"][0]["message"].startswith("line 11: ")  # ingest's own message
    assert figures["prompt_tokens"] == sum(map(len, prompts))
    assert 0 < figures["cached_prompt_tokens"] < figures["prompt_tokens"]  # the shared system prompt
    assert figures["cached_prompt_tokens"] % 16 == 0  # whole KV blocks
    assert figures["max_output_tokens"] == sum(6 + i % 3 for i in range(10))
    assert figures["expected_output_tokens"] == figures["max_output_tokens"]
    assert figures["expected_seconds"] is None
    assert any(line.startswith("assumption:") for line in figures["basis"])


def test_after_a_finished_job_the_estimate_uses_its_output_share_and_pace(env: Path,
                                                                          tiny_llama: Path) -> None:
    write_requests(env / "calibration.jsonl", 20)
    result = CliRunner().invoke(main, ["run", str(env / "calibration.jsonl"), "-o", str(env / "out.jsonl")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    write_requests(env / "next.jsonl", 30)
    figures = _estimate(env / "next.jsonl")
    assert figures["expected_output_tokens"] <= figures["max_output_tokens"]
    assert any("finished requests of" in line for line in figures["basis"])
    assert figures["expected_seconds"] is None and figures["live_workers"] == 0  # `run` left no worker

    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory
    from batchinfer.store.workers import register_worker

    settings = Settings(data_dir=env / "data")
    with session_factory(settings.effective_database_url)() as session:  # a live worker of the model
        register_worker(session, worker_id="w1", model=str(tiny_llama), hostname=socket.gethostname())
    figures = _estimate(env / "next.jsonl")
    assert figures["live_workers"] == 1 and figures["expected_seconds"] > 0
    assert any("idle polling worker looks" in line for line in figures["basis"])  # no broker: it polls
    text = CliRunner().invoke(main, ["estimate", str(env / "next.jsonl")], catch_exceptions=False).output
    assert "expected_seconds" in text and "basis: seconds: decode steps" in text
