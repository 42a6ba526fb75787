"""A worker killed while building the native CPU attention extension never leaves later workers hanging.

torch's build lock is a plain file, so a builder killed mid-build (kill -9, OOM) used to leave it behind and
every later worker waited on it forever at "loading", silently. Now the build is also guarded by an flock
the kernel drops with its process: a stale torch lock is removed with a warning and the extension rebuilt,
and a live builder is waited for a bounded time, with log lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.native import build as native_build

LOAD = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level="INFO", format="%(levelname)s %(message)s")
    from batchinfer.engine.layers import cpu_attention
    print("LOADED" if cpu_attention.load(wait_s=float(sys.argv[1])) is not None else "NONE", flush=True)
""")
HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from batchinfer.engine.native import build as native_build
    directory = Path(sys.argv[1])
    with native_build.build_lock(directory, wait_s=5) as held:
        assert held
        (directory / native_build.COMPLETE_NAME).unlink(missing_ok=True)  # a build in progress is incomplete
        (directory / native_build.TORCH_LOCK_NAME).touch()  # what torch does when a build starts
        print("HOLDING", flush=True)
        time.sleep(600)  # "building" until killed
""")


@pytest.fixture
def extensions_dir(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The extension's build directory under a BATCHINFER_KERNEL_DIR of these tests' own.

    It persists across runs (like torch's own cache), so only the first run compiles (about a minute on
    2 cores); later runs find the build up to date. The user's torch cache is never touched.
    """
    root = Path(tempfile.gettempdir()) / f"batchinfer-test-torch-extensions-{os.getuid()}"
    monkeypatch.setenv("BATCHINFER_KERNEL_DIR", str(root))
    monkeypatch.delenv("BATCHINFER_CPU_ATTENTION", raising=False)
    return root / cpu_attention.extension_name()


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=timeout,
                          env=os.environ.copy())


def _kill_while_building(directory: Path) -> None:
    """Start a process that takes both locks as a builder does, then kill -9 it mid-"build"."""
    directory.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (directory / native_build.TORCH_LOCK_NAME).exists()  # left behind, as a killed build leaves it


def test_a_lock_left_by_a_killed_builder_is_removed_and_the_extension_loads(extensions_dir: Path):
    _kill_while_building(extensions_dir)
    done = _run(LOAD, "60", timeout=420)  # builds from scratch (about a minute) unless a build was seeded
    assert done.stdout.strip() == "LOADED", done.stderr[-3000:]
    assert "removing the stale build lock" in done.stderr and "rebuilding" in done.stderr
    assert "building native CPU kernels (one time" in done.stderr  # the (re)build is announced
    assert not (extensions_dir / native_build.TORCH_LOCK_NAME).exists()


def test_a_live_builder_is_waited_for_a_bounded_time_with_log_lines(extensions_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    extensions_dir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(extensions_dir)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        monkeypatch.setattr(native_build, "BUILD_WAIT_LOG_S", 0.5)
        started = time.monotonic()
        with native_build.build_lock(extensions_dir, wait_s=2.0) as held:
            waited = time.monotonic() - started
        assert held is False and 2.0 <= waited < 10  # gave up, in bounded time
        # The process loading the extension falls back to SDPA and says why, instead of hanging.
        done = _run(LOAD, "2", timeout=120)
        assert done.stdout.strip() == "NONE", done.stderr[-3000:]
        assert f"process {holder.pid} has been building" in done.stderr and "SDPA" in done.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with native_build.build_lock(extensions_dir, wait_s=2.0) as held:  # its death freed the lock at once
        assert held is True
        assert not (extensions_dir / native_build.TORCH_LOCK_NAME).exists()  # and its torch lock is gone
