"""`batchinfer run` typed as `vllm run-batch` users type it (issue 18): -i/-o, --model, and errors
written into the results file in input order with --errors-in-output."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from tests.workers.helpers import read_lines, write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    return tmp_path


def test_run_with_vllm_flags_and_errors_in_output(env: Path, tiny_llama: Path) -> None:
    bad = orjson.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": "x"}], "temperature": 9}})
    ids = write_requests(env / "in.jsonl", 3, extra_lines=[bad])
    lines = (env / "in.jsonl").read_bytes().splitlines(keepends=True)
    (env / "in.jsonl").write_bytes(lines[0] + lines[3] + lines[1] + lines[2])  # the bad line second
    result = CliRunner().invoke(main, ["run", "-i", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"),
                                       "--model", str(tiny_llama), "--errors-in-output", "--json"])
    assert result.exit_code == 3, result.output  # completed, one request failed
    assert orjson.loads(result.stdout)["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    out = read_lines(env / "out.jsonl")
    assert [line["custom_id"] for line in out] == [ids[0], "bad", ids[1], ids[2]]  # input order
    assert out[1]["response"] is None and "temperature" in out[1]["error"]["message"]
    assert all(line["response"]["status_code"] == 200 for line in out if line["custom_id"] != "bad")
    assert not (env / "out.errors.jsonl").exists()  # nothing written beside it


def test_run_input_option_checks(env: Path, tiny_llama: Path) -> None:
    def run(*args: str):
        return CliRunner().invoke(main, ["run", *args, "--model", str(tiny_llama)])

    write_requests(env / "in.jsonl", 1)
    neither = run("-o", str(env / "o.jsonl"))
    assert neither.exit_code == 1 and "no input file: give FILE or -i/--input FILE" in neither.stderr
    both = run(str(env / "in.jsonl"), "-i", str(env / "other.jsonl"), "-o", str(env / "o.jsonl"))
    assert both.exit_code == 1 and "two input files" in both.stderr
    clash = run("-i", str(env / "in.jsonl"), "-o", str(env / "o.jsonl"), "--errors-in-output", "--errors",
                str(env / "e.jsonl"))
    assert clash.exit_code == 1 and "--errors-in-output" in clash.stderr
    missing = run("--input-file", str(env / "absent.jsonl"), "--output-file", str(env / "o.jsonl"))
    assert missing.exit_code == 1 and "no such file" in missing.stderr
    assert not (env / "o.jsonl").exists()
