"""`kv_cache_dtype` as a user setting (issue 30): BATCHINFER_KV_CACHE_DTYPE and `--kv-cache-dtype` of
`batchinfer run` and `batchinfer worker` reach EngineConfig; a value outside the choices is one line
naming the setting (or flag) and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.config import Settings, load_settings
from batchinfer.config_sources import ConfigError
from batchinfer.engine.kv_cache_dtypes import KV_CACHE_DTYPES
from tests.cli.helpers import invoke, invoke_worker_once, tiny_model_env
from tests.workers.helpers import read_lines, write_requests

ALLOWED = ", ".join(KV_CACHE_DTYPES)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> Path:
    write_requests(tmp_path / "in.jsonl", 3)
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


@pytest.fixture
def built_configs(monkeypatch: pytest.MonkeyPatch) -> list:
    """The EngineConfig of every engine workers.process builds in this test."""
    import workers.process as process

    seen = []
    original = process.build_engine

    def spy(model, settings, **overrides):
        engine = original(model, settings, **overrides)
        seen.append(engine.config)
        return engine

    monkeypatch.setattr(process, "build_engine", spy)
    return seen


def test_the_setting_reaches_the_engine_kwargs():
    assert Settings().engine_kwargs()["kv_cache_dtype"] == "auto"
    assert Settings(kv_cache_dtype="int8").engine_kwargs()["kv_cache_dtype"] == "int8"
    assert Settings(kv_cache_dtype="uint8").kv_cache_dtype == "u8"  # EngineConfig's alias


def test_an_invalid_setting_names_it_and_the_choices(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ConfigError, match=f"kv_cache_dtype = 'int4' .*must be one of {ALLOWED}"):
        load_settings(kv_cache_dtype="int4")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_DTYPE", "fp16")
    shown = invoke("config", "show")
    assert shown.exit_code == 1
    assert "BATCHINFER_KV_CACHE_DTYPE" in shown.stderr and ALLOWED in shown.stderr, shown.stderr


@pytest.mark.parametrize("command", ["run", "worker"])
def test_an_invalid_flag_names_it_and_the_choices(env: Path, command: str):
    args = [str(env / "in.jsonl"), "-o", str(env / "out.jsonl")] if command == "run" else []
    result = invoke(command, *args, "--kv-cache-dtype", "int4")
    assert result.exit_code == 2  # click's usage error, before anything runs
    assert "--kv-cache-dtype" in result.stderr and "'int4'" in result.stderr
    assert all(f"'{choice}'" in result.stderr for choice in KV_CACHE_DTYPES), result.stderr


def test_run_flag_reaches_the_engine(env: Path, tiny_llama: Path, built_configs: list):
    result = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--model", str(tiny_llama),
                  "--kv-cache-dtype", "int8")
    assert result.exit_code == 0, result.output
    assert [config.kv_cache_dtype for config in built_configs] == ["int8"]
    lines = read_lines(env / "out.jsonl")
    assert len(lines) == 3 and all(line["error"] is None for line in lines)
    assert all(line["provenance"]["kv_cache_dtype"] == "int8" for line in lines)


def test_run_setting_reaches_the_engine(env: Path, tiny_llama: Path, built_configs: list,
                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BATCHINFER_KV_CACHE_DTYPE", "u8")
    result = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--model", str(tiny_llama))
    assert result.exit_code == 0, result.output
    assert [config.kv_cache_dtype for config in built_configs] == ["u8"]


def test_worker_flag_reaches_the_engine(env: Path, tiny_llama: Path, built_configs: list,
                                        monkeypatch: pytest.MonkeyPatch):
    import workers.process as process

    result = invoke_worker_once(monkeypatch, "--model", str(tiny_llama), "--kv-cache-dtype", "fp8_e4m3",
                                "--json")
    assert result.exit_code == 0, result.output
    assert [config.kv_cache_dtype for config in built_configs] == ["fp8_e4m3"]
    assert process.process_engine_overrides["kv_cache_dtype"] == "fp8_e4m3"


def test_int8_weights_run_over_a_u8_cache_unless_asked_for_the_model_dtype(env: Path, tiny_llama: Path,
                                                                           built_configs: list):
    """`batchinfer run --quantization int8`: float32 activations over a u8 cache, named in each line's
    provenance; `--kv-cache-dtype fp32` keeps the float32 cache, whose provenance names no cache."""
    for flags, cache in [((), "u8"), (("--kv-cache-dtype", "fp32"), None)]:
        out = env / f"out-{cache}.jsonl"
        result = invoke("run", str(env / "in.jsonl"), "-o", str(out), "--model", str(tiny_llama),
                        "--quantization", "int8", *flags)
        assert result.exit_code == 0, result.output
        lines = read_lines(out)
        assert len(lines) == 3 and all(line["error"] is None for line in lines)
        provenance = [line["provenance"] for line in lines]
        assert all(p.get("kv_cache_dtype") == cache for p in provenance), provenance[0]
    assert [config.resolved_dtype_name() for config in built_configs] == ["float32", "float32"]
