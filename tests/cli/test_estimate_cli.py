"""`batchinfer estimate` (issue 32): the file read as ingest reads it, prompt tokens from the model's own
tokenizer and chat template, shared prefixes, caps; output and seconds from this deployment's history."""

from __future__ import annotations

import socket
from pathlib import Path

import orjson
import pytest
from transformers import AutoTokenizer

from tests.cli.helpers import cli, tiny_model_env
from tests.workers.helpers import write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


def _estimate(path: Path) -> dict:
    code, out = cli("estimate", str(path), "--json")
    assert code == 0, out
    return orjson.loads(out)


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
    code, out = cli("run", str(env / "calibration.jsonl"), "-o", str(env / "out.jsonl"))
    assert code == 0, out
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
    code, out = cli("submit", str(env / "next.jsonl"), "--json")  # the same figures, shown at submit
    assert code == 0, out
    at_submit = orjson.loads(out)["estimate"]
    for name in ("requests", "invalid_lines", "max_output_tokens", "expected_output_tokens", "live_workers"):
        assert at_submit[name] == figures[name], name
    # the idle worker's poll wait (at most 2.5 s) grows between the two
    assert at_submit["expected_seconds"] == pytest.approx(figures["expected_seconds"], abs=2.5)
    assert at_submit["prompt_tokens"] is None  # not tokenized again at submit
    text = cli("estimate", str(env / "next.jsonl"))[1]
    assert "expected_seconds" in text and "basis: seconds: decode steps" in text


def test_result_cache_hits_are_what_the_workers_then_serve(env: Path) -> None:
    write_requests(env / "night1.jsonl", 6, seeded=True)  # seeded: deterministic, so cached
    first = _estimate(env / "night1.jsonl")
    assert first["result_cache_hits"] is None  # no result records the workers' identity yet
    assert any(line.startswith("result cache: unknown") for line in first["basis"])
    code, out = cli("run", str(env / "night1.jsonl"), "-o", str(env / "out1.jsonl"))
    assert code == 0, out
    lines = (env / "night1.jsonl").read_bytes().splitlines()
    changed = []
    for line in lines[4:]:  # two lines of the next night sample with another seed
        request = orjson.loads(line)
        changed.append(orjson.dumps({**request, "body": {**request["body"], "seed": 7}}))
    (env / "night2.jsonl").write_bytes(b"\n".join(lines[:4] + changed) + b"\n")

    figures = _estimate(env / "night2.jsonl")
    assert figures["result_cache_hits"] == 4
    assert any(line.startswith("result cache: 4 of 6 requests") for line in figures["basis"])
    code, out = cli("run", str(env / "night2.jsonl"), "-o", str(env / "out2.jsonl"), "--json")
    assert code == 0, out
    assert orjson.loads(out.strip().splitlines()[-1])["result_cache"]["hits"] == 4  # the same keys
