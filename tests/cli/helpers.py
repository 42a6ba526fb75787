"""What the CLI tests share: the CLI invoked in-process, and the environment of a local run on the tiny
model (SQLite under tmp_path, CPU, a small KV cache)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from batchinfer.cli import main


def cli(*args: str) -> tuple[int, str]:
    """(exit code, output) of `batchinfer ARGS`, exceptions raised as they are."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def invoke(*args: str) -> Result:
    """click's Result of `batchinfer ARGS` (stdout and stderr apart, exceptions caught), with the settings
    read afresh: the environment a test set is the one used."""
    from batchinfer.config import get_settings

    get_settings.cache_clear()
    return CliRunner().invoke(main, list(args))


def tiny_model_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path) -> Path:
    """Point the settings at a data dir under tmp_path and `model` on the CPU; returns tmp_path."""
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", str(model))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    return tmp_path


def invoke_worker_once(monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    """`batchinfer worker ARGS` started and stopped at once (no polling), its module globals and signal
    handlers restored afterwards."""
    import workers.process as process

    monkeypatch.setattr(process, "poll_forever", lambda runner, stop: None)  # started, then done at once
    for name in ("process_model", "process_settings", "process_engine_overrides", "process_metrics_port"):
        monkeypatch.setattr(process, name, getattr(process, name))  # the command sets them: restored after
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return invoke("worker", *args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
