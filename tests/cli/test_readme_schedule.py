"""The README's schedule example runs as printed (issue 29 item 4).

The commands of the README's "Scheduled nightly pipelines" block are run as a shell would run them, in
separate processes: `cd` and `export` as written (with /srv/batch moved to a temporary directory), then
`schedule add` (its webhook host, hooks.example.com, need not resolve: only its form is checked), a
`run-now` from another directory, and `batchinfer scheduler` and `batchinfer worker` started from yet
other directories. The results and errors files appear under the directory `add` ran in, which is what
a relative template resolved against each process's own directory got wrong.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import orjson
import pytest

from tests.metrics.helpers import local_worker, worker_env
from tests.workers.helpers import read_lines, write_requests

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_ROOT = "/srv/batch"


def _example_lines() -> list[str]:
    """The command lines of the README's schedule block, continuation lines joined."""
    section = README.read_text().split("### Scheduled nightly pipelines", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "README: the schedule section lost its bash block"
    return [line for line in block.group(1).replace("\\\n", " ").splitlines() if line.strip()]


def _batchinfer(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinfer.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name in ("srv", "elsewhere", "ticker"):
        (tmp_path / name).mkdir()
    return tmp_path


def test_the_readme_schedule_example_runs_as_printed(root: Path, tiny_llama: Path) -> None:
    srv = root / "srv"
    env = worker_env(database_url=f"sqlite:///{root / 'data' / 'batchinfer.db'}", data_dir=root / "data",
                     model=tiny_llama, schedule_tick_seconds="0.5", rescue_interval_seconds="1")
    env.pop("BATCHINFER_DATABASE_URL")  # as a user has it: the SQLite file in the data dir
    env["SECRET"] = "s3cret"
    rome = ZoneInfo("Europe/Rome")
    days = sorted({(datetime.now(UTC) + timedelta(seconds=s)).astimezone(rome).strftime("%Y-%m-%d")
                   for s in (0, 120)})  # run-now's day, also when Rome's midnight falls meanwhile
    for day in days:
        (srv / "data" / day).mkdir(parents=True)
        ids = write_requests(srv / "data" / day / "prompts.jsonl", 3)

    cwd = root / "elsewhere"
    long_running: list[list[str]] = []
    for line in _example_lines():
        words = [word.replace(EXAMPLE_ROOT, str(srv)).replace("$SECRET", env["SECRET"])
                 for word in shlex.split(line, comments=True)]
        if words[0] == "cd":
            cwd = Path(words[1])
        elif words[0] == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
        elif words[1] in ("scheduler", "worker"):
            long_running.append(words[1:])
        else:
            done = _batchinfer(words[1:], cwd=cwd, env=env)
            assert done.returncode == 0, (line, done.stdout, done.stderr)
            if words[1:3] == ["schedule", "add"]:
                assert "Europe/Rome" in done.stdout, done.stdout  # the next run, in the schedule's zone
                assert f"{srv}/data/{{date:%Y-%m-%d}}/prompts.jsonl" in done.stdout  # stored absolute
            cwd = root / "elsewhere"  # every later command from another directory
    assert [args[0] for args in long_running] == ["scheduler", "worker"]

    candidates = [srv / "results" / f"{day}.jsonl" for day in days]
    with ExitStack() as stack:
        log = root / "scheduler.log"
        with log.open("wb") as out:
            scheduler = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", *long_running[0]],
                                         cwd=root / "ticker", env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        stack.callback(_stop, scheduler)
        worker = stack.enter_context(local_worker({**env}, root / "worker.log"))
        deadline = time.monotonic() + 180
        while not any(path.exists() for path in candidates):
            assert scheduler.poll() is None, log.read_text()[-3000:]
            assert worker.poll() is None, (root / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (log.read_text()[-3000:],
                                                 (root / "worker.log").read_text()[-3000:])
            time.sleep(0.2)
    results = next(path for path in candidates if path.exists())
    assert [line["custom_id"] for line in read_lines(results)] == ids
    assert results.with_name(results.stem + ".errors.jsonl").exists()
    assert not list((root / "ticker").iterdir())  # nothing written where the scheduler runs
    shown = _batchinfer(["schedule", "show", "nightly", "--json"], cwd=root / "elsewhere", env=env)
    runs = orjson.loads(shown.stdout)["runs"]
    assert [run["status"] for run in runs] == ["completed"] and runs[0]["output"] == str(results)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
