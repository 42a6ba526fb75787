"""The native CPU kernels are built once per installation and found again (issue 29, item 1).

`batchinfer build-kernels` (what `make setup` and the Docker image run) builds them, or says they are
built; the cache is keyed by what decides the binary, and one venv reached through a symlink is one cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import pytest

from batchinfer.engine.native import build as native_build

# Shared with tests/workers/test_extension_build_lock.py: only the first run of either compiles.
KERNEL_ROOT = Path(tempfile.gettempdir()) / f"batchinfer-test-torch-extensions-{os.getuid()}"


def _build_kernels(kernel_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BATCHINFER_KERNEL_DIR": str(kernel_dir)}
    env.pop("BATCHINFER_CPU_ATTENTION", None)
    return subprocess.run([sys.executable, "-m", "batchinfer.cli", "build-kernels", "--json"], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.integration  # two `batchinfer build-kernels` processes
def test_build_kernels_builds_once_and_a_path_alias_finds_the_same_build(tmp_path: Path):
    first = _build_kernels(KERNEL_ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    built = orjson.loads(first.stdout)  # stdout is the one JSON object
    if built["built"]:  # compiled now: the user was told, with progress
        assert "building native CPU kernels (one time" in first.stderr
        assert "native CPU kernels built in" in first.stderr
    alias = tmp_path / "alias"
    alias.symlink_to(KERNEL_ROOT)
    again = _build_kernels(alias)
    assert again.returncode == 0, again.stderr[-3000:]
    found = orjson.loads(again.stdout)
    assert found["built"] is False and found["directory"] == built["directory"]  # no rebuild
    assert "building" not in again.stderr


def test_a_venv_reached_through_a_symlink_is_one_cache(tmp_path: Path):
    alias = tmp_path / "venv-alias"
    alias.symlink_to(Path(sys.prefix))
    code = "from batchinfer.engine.native import build as native_build; print(native_build.kernel_dirs()[0])"
    env = {key: value for key, value in os.environ.items() if key != native_build.KERNEL_DIR_ENV}
    dirs = [subprocess.run([str(prefix / "bin" / "python"), "-c", code], env=env, capture_output=True,
                           text=True, timeout=120, check=True).stdout.strip()
            for prefix in (Path(sys.prefix), alias)]
    assert dirs[0] == dirs[1] == str((Path(sys.prefix) / "share" / "batchinfer" / "kernels").resolve())


@pytest.mark.parametrize("change", ["source", "cflags", "ldflags"])
def test_the_key_changes_with_what_decides_the_binary(change: str):
    base = {"source": "int f();", "cflags": ["-O3"], "ldflags": ["-fopenmp"]}
    changed = {**base, change: base[change] + (" " if change == "source" else ["-g"])}
    assert native_build.cache_key(**base) == native_build.cache_key(**base)
    assert native_build.cache_key(**changed) != native_build.cache_key(**base)


def test_the_cpp_sources_ship_as_package_data_and_are_hashed_into_the_key(tmp_path: Path):
    """Every C++ file of csrc/ is matched by pyproject's package-data (a wheel holds it) and is in the key."""
    import fnmatch
    import shutil
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    globs = project["tool"]["setuptools"]["package-data"]["batchinfer.engine.native"]
    files = sorted(p.name for p in native_build.CSRC_DIR.iterdir() if p.suffix in (".cpp", ".h"))
    assert set(native_build.SOURCES) <= set(files)
    assert all(any(fnmatch.fnmatch(f"csrc/{name}", glob) for glob in globs) for name in files)
    copy = shutil.copytree(native_build.CSRC_DIR, tmp_path / "csrc")
    assert native_build.source_text(copy) == native_build.source_text()
    header = copy / "cpu_kernels.h"
    header.write_text(header.read_text() + "\n")  # a header edit alone is a new binary too
    assert native_build.cache_key(native_build.source_text(copy), ["-O3"], []) != native_build.cache_key(
        native_build.source_text(), ["-O3"], [])
