"""`float32_matmul_precision` as a user setting: BATCHINFER_FLOAT32_MATMUL_PRECISION and
`--float32-matmul-precision` of `batchinfer run` and `batchinfer worker` reach EngineConfig; a value outside
the choices is one line naming the setting (or flag) and the allowed values; on an AMX CPU a job's lines
name in their provenance the precision their float32 GEMMs ran at (auto: embeddings in bf16x3)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchinfer.config import Settings, load_settings
from batchinfer.config_sources import ConfigError
from batchinfer.engine.config import FLOAT32_MATMUL_PRECISIONS
from batchinfer.engine.layers.amx_linear import amx_extension
from tests.cli.helpers import invoke, invoke_worker_once, tiny_model_env
from tests.cli.test_kv_cache_dtype_option import built_configs  # noqa: F401  # the fixture
from tests.workers.helpers import read_lines, write_requests

ALLOWED = ", ".join(FLOAT32_MATMUL_PRECISIONS)
needs_amx = pytest.mark.skipif(amx_extension() is None, reason="bf16x3 GEMMs need a CPU with AMX bf16 tiles")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> Path:
    write_requests(tmp_path / "in.jsonl", 3)
    lines = [{"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": [f"a text number {i}", "another one"]}} for i in range(2)]
    (tmp_path / "embed.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


def test_the_setting_reaches_the_engine_kwargs() -> None:
    assert Settings().engine_kwargs()["float32_matmul_precision"] == "auto"
    assert Settings(float32_matmul_precision="high").engine_kwargs()["float32_matmul_precision"] == "high"


def test_an_invalid_setting_names_it_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="float32_matmul_precision = 'medium'"):
        load_settings(float32_matmul_precision="medium")
    monkeypatch.setenv("BATCHINFER_FLOAT32_MATMUL_PRECISION", "tf32")
    shown = invoke("config", "show")
    assert shown.exit_code == 1
    assert "BATCHINFER_FLOAT32_MATMUL_PRECISION" in shown.stderr
    assert all(f"'{choice}'" in shown.stderr for choice in FLOAT32_MATMUL_PRECISIONS), shown.stderr


@pytest.mark.parametrize("command", ["run", "worker"])
def test_an_invalid_flag_names_it_and_the_choices(env: Path, command: str) -> None:
    args = [str(env / "in.jsonl"), "-o", str(env / "out.jsonl")] if command == "run" else []
    result = invoke(command, *args, "--float32-matmul-precision", "medium")
    assert result.exit_code == 2  # click's usage error, before anything runs
    assert "--float32-matmul-precision" in result.stderr and "'medium'" in result.stderr
    assert all(f"'{choice}'" in result.stderr for choice in FLOAT32_MATMUL_PRECISIONS), result.stderr


def _run(env: Path, tiny_llama: Path, job: str, *flags: str) -> list[dict]:
    out = env / f"out-{job}-{'-'.join(flags) or 'default'}.jsonl"
    result = invoke("run", str(env / f"{job}.jsonl"), "-o", str(out), "--model", str(tiny_llama),
                    "--dtype", "float32", *flags)
    assert result.exit_code == 0, result.output
    lines = read_lines(out)
    assert lines and all(line["error"] is None for line in lines), lines[0]
    return lines


def test_run_flag_reaches_the_engine(env: Path, tiny_llama: Path, built_configs: list) -> None:  # noqa: F811
    lines = _run(env, tiny_llama, "in", "--float32-matmul-precision", "highest")
    assert [config.float32_matmul_precision for config in built_configs] == ["highest"]
    assert all("float32_matmul_precision" not in line["provenance"] for line in lines)


def test_worker_flag_reaches_the_engine(env: Path, tiny_llama: Path, built_configs: list,  # noqa: F811
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.process as process

    result = invoke_worker_once(monkeypatch, "--model", str(tiny_llama), "--float32-matmul-precision", "high",
                                "--json")
    assert result.exit_code == 0, result.output
    assert [config.float32_matmul_precision for config in built_configs] == ["high"]
    assert process.process_engine_overrides["float32_matmul_precision"] == "high"


@needs_amx
def test_provenance_names_the_precision_the_gemms_ran_at(env: Path, tiny_llama: Path) -> None:
    """auto (the default) on an AMX CPU: embeddings in bf16x3, chat in IEEE float32, both lines saying
    "auto"; --float32-matmul-precision high: every line says "high"."""
    for job in ("in", "embed"):
        assert {line["provenance"].get("float32_matmul_precision") for line in _run(env, tiny_llama, job)} \
            == {"auto"}
        high = _run(env, tiny_llama, job, "--float32-matmul-precision", "high")
        assert {line["provenance"].get("float32_matmul_precision") for line in high} == {"high"}
