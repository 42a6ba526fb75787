"""A newcomer's first hour, typed as a shell user types it (issue 29: items 1, 2, 6, 8).

The installed `batchinfer` script in subprocesses, one data dir, a tiny model standing in for the local
one: a one-line job, vLLM's example batch file with --served-model-name, a line naming a model that is
not served, the mistakes vLLM users make (a hub id, fp16, gpu) as one line each, and `submit -q`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

BATCHINFER = str(Path(sys.executable).parent / "batchinfer")
VLLM_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


@pytest.fixture
def shell(tmp_path: Path):
    environ = {**os.environ, "BATCHINFER_DATA_DIR": str(tmp_path / "data"), "BATCHINFER_DEVICE": "cpu",
               "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(16 << 20)}

    def run(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([BATCHINFER, *args], env={**environ, **extra_env}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    return run


def _line(custom_id: str, model: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "max_completion_tokens": 6, "messages": [
                             {"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": "Hello world!"}]}}) + b"\n"


def test_first_hour(shell, tmp_path: Path, tiny_llama: Path) -> None:
    model = str(tiny_llama)
    (tmp_path / "one.jsonl").write_bytes(_line("only", model))
    one = shell("run", "one.jsonl", "-o", "one.out.jsonl", "--model", model)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "Traceback" not in one.stderr and "loading" in one.stderr

    # vLLM's example file, its body.model served under its name (item 6)
    (tmp_path / "openai_example_batch.jsonl").write_bytes(_line("request-1", VLLM_MODEL)
                                                          + _line("request-2", VLLM_MODEL))
    example = shell("run", "-i", "openai_example_batch.jsonl", "-o", "results.jsonl", "--model", model,
                    "--served-model-name", VLLM_MODEL, "--dtype", "half", "--max-model-len", "128")
    assert example.returncode == 0, example.stderr[-3000:]
    # beside a line of the local model, without the name: that line errors alone, as vLLM answers it
    (tmp_path / "mixed.jsonl").write_bytes(_line("request-1", VLLM_MODEL) + _line("mine", model))
    unknown = shell("run", "-i", "mixed.jsonl", "-o", "results2.jsonl", "--model", model,
                    "--errors-in-output")
    assert unknown.returncode == 3, unknown.stderr[-3000:]  # completed, one request failed
    lines = [orjson.loads(line) for line in (tmp_path / "results2.jsonl").read_text().splitlines()]
    assert lines[0]["custom_id"] == "request-1" and lines[0]["error"]["code"] == "model_not_found"
    assert lines[1]["custom_id"] == "mine" and lines[1]["response"]["status_code"] == 200

    # mistakes: one line each, exit 1, no job left behind (item 2)
    for args, env, needle in [
        (("run", "one.jsonl", "-o", "x.jsonl", "--model", VLLM_MODEL), {}, "Hugging Face cache"),
        (("config", "show"), {"BATCHINFER_DTYPE": "fp16"}, "dtype"),
        (("config", "show"), {"BATCHINFER_DEVICE": "gpu"}, "device"),
        (("submit", "one.jsonl"), {"BATCHINFER_BROKER_URL": "redis://127.0.0.1:1/0"}, "broker"),
    ]:
        result = shell(*args, **env)
        assert result.returncode == 1, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and needle in result.stderr, (args, result.stderr)
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1

    # scripts: the bare id (item 8)
    submitted = shell("submit", "-q", "one.jsonl", "--model", model)
    assert submitted.returncode == 0 and re.fullmatch(r"batch_\d+\n", submitted.stdout), submitted
    listed = [orjson.loads(line) for line in shell("list", "--json").stdout.splitlines()]
    assert [batch["id"] for batch in listed][0] == submitted.stdout.strip()
    assert {batch["status"] for batch in listed} <= {"completed", "in_progress"}  # none failed or stuck
