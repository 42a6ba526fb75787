"""The engine's thread policy (engine/native/threads.py): thread count, OpenMP wait defaults, user values."""

from __future__ import annotations

import os
import subprocess
import sys

from batchinfer.engine.native.threads import (
    CHOSEN_MARKER,
    OPENMP_WAIT_DEFAULTS,
    choose_num_threads,
    configure_openmp_env,
    other_runnable_tasks,
    usable_cores,
)


def test_every_core_on_a_quiet_machine():
    assert choose_num_threads(2, 0) == 2
    assert choose_num_threads(16, 0) == 16


def test_one_thread_fewer_when_other_work_is_runnable():
    assert choose_num_threads(2, 1) == 1
    assert choose_num_threads(8, 3) == 7


def test_a_single_core_keeps_its_one_thread():
    assert choose_num_threads(1, 0) == 1
    assert choose_num_threads(1, 5) == 1


def test_defaults_fill_an_empty_environment():
    env: dict[str, str] = {}
    applied = configure_openmp_env(env)
    assert env.pop(CHOSEN_MARKER).split(",") == sorted(applied)  # so a child can tell ours from the user's
    assert applied == env
    for name, value in OPENMP_WAIT_DEFAULTS.items():
        assert env[name] == value
    assert 1 <= int(env["OMP_NUM_THREADS"]) <= usable_cores()


def test_the_users_values_are_never_overridden():
    env = {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}
    applied = configure_openmp_env(env)
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_NUM_THREADS" not in applied and "OMP_WAIT_POLICY" not in applied
    assert env["GOMP_SPINCOUNT"] == OPENMP_WAIT_DEFAULTS["GOMP_SPINCOUNT"]


def test_the_marker_keeps_what_a_parent_chose():
    env = {"OMP_NUM_THREADS": "1", CHOSEN_MARKER: "OMP_NUM_THREADS"}  # inherited from a parent's choice
    configure_openmp_env(env)
    assert set(env[CHOSEN_MARKER].split(",")) == {"OMP_NUM_THREADS", *OPENMP_WAIT_DEFAULTS}


def test_configuring_twice_changes_nothing_the_second_time():
    env: dict[str, str] = {}
    configure_openmp_env(env)
    first = dict(env)
    assert configure_openmp_env(env) == {}
    assert env == first


def test_usable_cores_is_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_runnable_tasks_are_counted_without_ourselves():
    assert 0 <= other_runnable_tasks(samples=2, interval_s=0.0) < 10_000


def test_torch_imported_afterwards_runs_the_chosen_thread_count():
    """The defaults are read by libgomp when torch is imported: a fresh process sees the chosen count."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    script = (
        "from batchinfer.engine.native.threads import configure_openmp_env\n"
        "applied = configure_openmp_env()\n"
        "import torch\n"
        "print(applied['OMP_NUM_THREADS'], torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    chosen, running = out.stdout.split()
    assert chosen == running
