"""The image (issue 18): torch pinned from a CUDA wheel index given as a build argument, a non-root user, a
HEALTHCHECK that knows api from worker, a .dockerignore that keeps the multi-GB .venv out of the context,
and a compose file valid for the Compose Specification (what `docker compose` v2 reads)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
# The Compose Specification's schema, as Debian's docker-compose package ships it.
COMPOSE_SPEC = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_torch_is_pinned_from_a_build_argument_index_before_the_package() -> None:
    steps = _instructions()
    args = dict(value.split("=", 1) for kind, value in steps if kind == "ARG" and "=" in value)
    makefile_pin = re.search(r"TORCH_SPEC \?= torch==(\S+)", (ROOT / "Makefile").read_text()).group(1)
    assert args["TORCH_VERSION"] == makefile_pin
    assert args["TORCH_INDEX_URL"].startswith("https://") and "/whl/cu" in args["TORCH_INDEX_URL"]
    runs = [value for kind, value in steps if kind == "RUN"]
    torch = next(i for i, run in enumerate(runs) if "torch==${TORCH_VERSION}" in run)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch]
    package = next(i for i, run in enumerate(runs) if "pip install '.[postgres]'" in run)
    assert torch < package


def test_runs_as_a_non_root_user_with_a_healthcheck() -> None:
    steps = _instructions()
    kinds = [kind for kind, _ in steps]
    user = next(value for kind, value in steps if kind == "USER")
    assert user not in ("root", "0") and kinds.index("USER") > kinds.index("RUN")
    assert any("useradd" in value and user in value for kind, value in steps if kind == "RUN")
    healthcheck = next(value for kind, value in steps if kind == "HEALTHCHECK")
    assert "batchinfer-healthcheck" in healthcheck and "--start-period" in healthcheck
    assert any(value.startswith("docker/healthcheck.py") for kind, value in steps if kind == "COPY")


def _pattern(rule: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**` any directories, `*` and `?` within one name."""
    out, i = "", 0
    while i < len(rule):
        if rule.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif rule.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(rule[i], re.escape(rule[i]))
            i += 1
    return re.compile(out)


def _ignored(path: str, rules: list[str]) -> bool:
    """Whether Docker leaves `path` out of the context: a rule matches the path or one of its parent
    directories, the last matching rule wins, and `!` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for rule in rules:
        negate = rule.startswith("!")
        regex = _pattern(rule.removeprefix("!").rstrip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_venv_out_and_what_the_image_copies_in() -> None:
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    for path in (".venv/bin/python", ".git/HEAD", ".hypothesis/examples/x", "tests/conftest.py",
                 "batchinfer/__pycache__/config.cpython-311.pyc", "batchinfer.egg-info/PKG-INFO",
                 "results/out.jsonl", "bench/e2e.py", "data.db"):
        assert _ignored(path, rules), path
    copied = [word for value in (v for k, v in _instructions() if k == "COPY") for word in value.split()[:-1]]
    assert copied  # every COPY source reaches the build
    for source in copied:
        assert not _ignored(source, rules), source
    for path in ("batchinfer/cli/__init__.py", "migrations/env.py", "batchinfer/kernels/__init__.py"):
        assert not _ignored(path, rules), path


@pytest.mark.skipif(not COMPOSE_SPEC.is_file(), reason="the Compose Specification schema (Debian's "
                    "docker-compose package) is not installed")
def test_compose_file_follows_the_compose_specification() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    config = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
    assert "version" not in config  # obsolete in the specification: v2 warns about it
    jsonschema.validate(config, json.loads(COMPOSE_SPEC.read_text()))
    services = config["services"]
    for name in ("api", "worker", "beat", "migrate"):
        assert services[name]["build"]["context"] == ".."  # the repository root: .dockerignore applies


@pytest.mark.skipif(subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
                    if shutil.which("docker") else True, reason="docker compose v2 is not installed")
def test_compose_v2_config_validates() -> None:
    result = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker" / "docker-compose.yml"),
                             "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def _healthcheck(cmdline: str, **env: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), "--cmdline", cmdline], timeout=60,
                          env={**os.environ, **env}).returncode


def test_healthcheck_checks_the_api_and_the_worker(tmp_path: Path, sqlite_url: str) -> None:
    from batchinfer.api.app import create_app
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.workers import register_worker
    from tests.api.conftest import make_settings
    from tests.api.helpers import serve

    upgrade(sqlite_url)
    with serve(create_app(make_settings(tmp_path, sqlite_url))) as base:
        port = base.rsplit(":", 1)[1]
        assert _healthcheck(f"api --host 0.0.0.0 --port {port}") == 0
    assert _healthcheck(f"api --port={port}") == 1  # stopped
    assert _healthcheck("beat") == 0

    env = {"BATCHINFER_DATABASE_URL": sqlite_url,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the venv's `batchinfer`
    assert _healthcheck("worker --model m", **env) == 1  # no live worker on this host yet
    with session_factory(sqlite_url)() as session:
        register_worker(session, worker_id=f"{socket.gethostname()}:1:m", model="m")
    assert _healthcheck("worker --model m", **env) == 0
