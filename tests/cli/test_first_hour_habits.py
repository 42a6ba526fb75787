"""vLLM's and shell habits on first try (issue 29, items 6 and 8): `run` takes vLLM's engine flags, runs
vLLM's own example batch file with `--served-model-name`, answers a line naming an unknown model alone
(`model_not_found`) while the rest runs; `submit -q` prints the bare id; `beat --json` keeps stdout JSON.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from tests.workers.helpers import read_lines

VLLM_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def _vllm_line(custom_id: str, model: str, content: str) -> bytes:
    """A line of vLLM's examples/offline_inference/openai_batch/openai_example_batch.jsonl."""
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [
                             {"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": content}], "max_completion_tokens": 8}})


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    return tmp_path


def test_vllm_example_file_runs_with_served_model_name_and_engine_flags(env: Path, tiny_llama: Path):
    source = env / "openai_example_batch.jsonl"
    source.write_bytes(_vllm_line("request-1", VLLM_MODEL, "Hello world!") + b"\n"
                       + _vllm_line("request-2", VLLM_MODEL, "Hello world!") + b"\n")
    result = CliRunner().invoke(main, [
        "run", "-i", str(source), "-o", str(env / "out.jsonl"), "--model", str(tiny_llama),
        "--served-model-name", VLLM_MODEL, "--dtype", "float", "--max-model-len", "128",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout)["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [line["response"]["status_code"] for line in read_lines(env / "out.jsonl")] == [200, 200]


def test_a_line_naming_an_unknown_model_errors_alone(env: Path, tiny_llama: Path):
    source = env / "in.jsonl"
    source.write_bytes(_vllm_line("mine", str(tiny_llama), "hi") + b"\n"
                       + _vllm_line("theirs", VLLM_MODEL, "hi") + b"\n"
                       + _vllm_line("plain", str(tiny_llama), "hello") + b"\n")
    result = CliRunner().invoke(main, ["run", str(source), "-o", str(env / "out.jsonl"), "--model",
                                       str(tiny_llama), "--errors-in-output"])
    assert result.exit_code == 3, result.output  # completed, one request failed
    lines = {line["custom_id"]: line for line in read_lines(env / "out.jsonl")}
    assert [lines[name]["response"]["status_code"] for name in ("mine", "plain")] == [200, 200]
    error = lines["theirs"]["error"]
    assert error["code"] == "model_not_found" and VLLM_MODEL in error["message"]
    assert str(tiny_llama) in error["message"]  # names the model that is served


def test_submit_quiet_prints_the_bare_batch_id(env: Path, tiny_llama: Path):
    source = env / "in.jsonl"
    source.write_bytes(_vllm_line("a", str(tiny_llama), "hi") + b"\n")
    result = CliRunner().invoke(main, ["submit", "-q", str(source), "--model", str(tiny_llama)])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"batch_\d+\n", result.stdout)


@pytest.mark.parametrize("command", ["beat", "worker"])
def test_celery_commands_json_stdout_is_pure_json(env: Path, redis_url: str, tiny_llama: Path, command: str):
    """Celery's banner and shutdown lines go to stderr: stdout holds the start line and nothing else."""
    environ = {**os.environ, "BATCHINFER_BROKER_URL": redis_url}
    args = ["--model", str(tiny_llama)] if command == "worker" else []
    beat = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", command, *args, "--json"], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        start = orjson.loads(beat.stdout.readline())
        assert start["event"] == f"{command}_started"
        deadline = time.monotonic() + 60
        seen = ""
        while not re.search(r"@\S+ ready", seen) and time.monotonic() < deadline:  # Celery's, on stderr
            seen += beat.stderr.readline()
        assert re.search(r"@\S+ ready", seen), seen[-2000:]
    finally:
        beat.send_signal(signal.SIGTERM)
        rest, errors = beat.communicate(timeout=60)
    assert rest == "", rest[:500]  # no banner, no "worker: Warm shutdown" on stdout
    assert "celery" in (seen + errors).lower()  # the banner went to stderr
