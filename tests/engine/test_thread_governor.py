"""The ThreadGovernor (engine/native/threads.py): the thread count re-chosen while the engine runs.

The policy is driven with a scripted /proc/stat and clock; one test runs it on the real /proc/stat beside
a real busy process, and the engine tests check who gets a governor and that its count is published.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.llm_engine import Engine
from batchinfer.engine.native.threads import (
    CHOSEN_MARKER,
    GOVERNOR_AGREEING_WINDOWS,
    ThreadGovernor,
    busy_cpu_seconds,
    configure_openmp_env,
    governor_ceiling,
    threads_beside,
    usable_cores,
)
from batchinfer.engine.sampling_params import SamplingParams

HZ = os.sysconf("SC_CLK_TCK")


def stat_text(busy_ticks: dict[int, int], idle_ticks: int = 0) -> str:
    """A /proc/stat with per-CPU busy time split over user and steal, plus lines that must be ignored."""
    lines = [f"cpu  {sum(busy_ticks.values()) * 9} 0 0 0 0 0 0 0 0 0"]
    for cpu, ticks in sorted(busy_ticks.items()):
        lines.append(f"cpu{cpu} {ticks - ticks // 4} 0 0 {idle_ticks} 7 0 0 {ticks // 4} 0 0")
    lines += ["intr 12345 1 2", "ctxt 999", "btime 1700000000", "procs_running 3"]
    return "\n".join(lines) + "\n"


class ScriptedMachine:
    """A clock, a /proc/stat and our CPU time that the test advances: `others` cores busy per second."""

    def __init__(self, cpus: set[int]) -> None:
        self.cpus, self.now, self.own = cpus, 0.0, 0.0
        self.busy = dict.fromkeys(cpus, 0)
        self.applied: list[int] = []

    def advance(self, seconds: float, *, others: float, ours: float) -> None:
        """`seconds` pass with other work on `others` cores and our threads on `ours` cores."""
        self.now += seconds
        self.own += ours * seconds
        share = round((others + ours) * seconds * HZ / len(self.cpus))
        for cpu in self.busy:
            self.busy[cpu] += share

    def governor(self, ceiling: int, current: int) -> ThreadGovernor:
        return ThreadGovernor(ceiling=ceiling, current=current, set_threads=self.applied.append,
                              cpus=self.cpus, clock=lambda: self.now, read_stat=lambda: stat_text(self.busy),
                              own_cpu=lambda: self.own)


def test_threads_beside_other_work():
    assert threads_beside(0.0, cores=2, ceiling=2) == 2
    assert threads_beside(0.3, cores=2, ceiling=2) == 2  # noise: a core is not taken
    assert threads_beside(0.5, cores=2, ceiling=2) == 1
    assert threads_beside(1.0, cores=2, ceiling=2) == 1
    assert threads_beside(2.0, cores=2, ceiling=2) == 1  # never below one thread
    assert threads_beside(2.5, cores=8, ceiling=8) == 5
    assert threads_beside(0.0, cores=8, ceiling=4) == 4  # never above the ceiling


def test_busy_time_counts_only_our_cpus_and_steal_but_not_idle():
    text = stat_text({0: 400, 1: 100, 5: 10_000}, idle_ticks=123_456)
    assert busy_cpu_seconds({0, 1}, text) == pytest.approx(500 / HZ)
    assert busy_cpu_seconds({5}, text) == pytest.approx(10_000 / HZ)
    assert busy_cpu_seconds({3}, text) == 0.0
    assert busy_cpu_seconds({0}, "") == 0.0


def test_one_thread_fewer_while_another_process_holds_a_core_and_back_when_it_leaves():
    machine = ScriptedMachine({0, 1})
    governor = machine.governor(ceiling=2, current=2)
    machine.advance(1.0, others=0.0, ours=2.0)
    assert governor.tick() == 2
    for _ in range(GOVERNOR_AGREEING_WINDOWS):  # a busy process arrives: ours share a core with it
        machine.advance(1.0, others=0.7, ours=1.3)
        governor.tick()
    assert governor.threads == 1 and machine.applied == [1]
    assert governor.other_busy_cores == pytest.approx(0.7, abs=0.05)
    machine.advance(1.0, others=1.0, ours=1.0)  # with one thread the process keeps its own core
    assert governor.tick() == 1
    for _ in range(GOVERNOR_AGREEING_WINDOWS):
        machine.advance(1.0, others=0.0, ours=1.0)
        governor.tick()
    assert governor.threads == 2 and machine.applied == [1, 2]


def test_a_single_busy_window_changes_nothing():
    machine = ScriptedMachine({0, 1})
    governor = machine.governor(ceiling=2, current=2)
    for others in (0.0, 1.0, 0.0, 1.0, 0.0):
        machine.advance(1.0, others=others, ours=2.0 - others)
        governor.tick()
    assert machine.applied == [] and governor.threads == 2


def test_nothing_is_read_between_windows():
    machine = ScriptedMachine({0, 1})
    reads = []
    governor = ThreadGovernor(ceiling=2, current=2, set_threads=machine.applied.append, cpus=machine.cpus,
                              clock=lambda: machine.now, own_cpu=lambda: machine.own,
                              read_stat=lambda: reads.append(1) or stat_text(machine.busy))
    reads.clear()
    for _ in range(50):
        machine.advance(0.01, others=1.0, ours=1.0)
        governor.tick()
    assert reads == []


def test_the_count_stays_within_one_and_the_ceiling():
    machine = ScriptedMachine(set(range(8)))
    governor = machine.governor(ceiling=4, current=4)
    for others in [0.0] * 3 + [7.5] * 3 + [0.0] * 3 + [3.0] * 3:
        machine.advance(1.0, others=others, ours=min(governor.threads, 8 - others))
        governor.tick()
        assert 1 <= governor.threads <= 4
    assert machine.applied == [1, 4]  # at the end 8 - 3 busy = 5, capped at 4: no change
    assert governor.threads == 4


def test_the_ceiling_is_every_core_only_where_batchinfer_chose_the_count():
    ours: dict[str, str] = {}
    configure_openmp_env(ours)
    chosen = int(ours["OMP_NUM_THREADS"])
    assert governor_ceiling(chosen, ours) == usable_cores()  # it may have taken one fewer at start
    assert governor_ceiling(1, {"OMP_NUM_THREADS": "1"}) == 1  # the user's value is a ceiling
    assert governor_ceiling(3, {"OMP_NUM_THREADS": "3"}) == 3
    # torch.set_num_threads after configure_openmp_env: that count is the user's
    if chosen > 1:
        assert governor_ceiling(chosen - 1, ours) == chosen - 1
    assert governor_ceiling(2, {}) == 2  # nobody chose: torch's default is the ceiling
    # a child process inherits the marker with the variables, so the count stays batchinfer's
    child = {"OMP_NUM_THREADS": "1", CHOSEN_MARKER: "GOMP_SPINCOUNT,OMP_NUM_THREADS"}
    assert governor_ceiling(1, child) == usable_cores()


@contextlib.contextmanager
def busy_loop_on(cpu: int) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(proc.pid, {cpu})
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not os.path.exists("/proc/stat") or usable_cores() < 2,
                    reason="needs /proc/stat and 2 usable cores")
def test_a_real_busy_process_takes_a_thread_and_gives_it_back():
    """On the real /proc/stat: a busy loop pinned to one of our cores lowers the count, its end raises it.

    A shared machine may be busy on its own: where it is, before or after the loop, the test skips
    rather than judge the governor by load it cannot control.
    """
    cpus = set(os.sched_getaffinity(0))
    applied: list[int] = []
    governor = ThreadGovernor(ceiling=len(cpus), current=len(cpus), set_threads=applied.append,
                              cpus=cpus, interval_s=0.3)

    def windows(n: int) -> None:
        for _ in range(n):
            time.sleep(0.31)
            governor.tick()

    windows(1)
    if governor.other_busy_cores >= 0.3:
        pytest.skip(f"the machine is busy already ({governor.other_busy_cores:.2f} cores)")
    with busy_loop_on(max(cpus)):
        windows(GOVERNOR_AGREEING_WINDOWS + 1)
        assert governor.other_busy_cores >= 0.6
        assert governor.threads < len(cpus)
    deadline = time.monotonic() + 20
    while governor.threads != len(cpus) and time.monotonic() < deadline:
        windows(1)
    if governor.threads != len(cpus) and governor.other_busy_cores >= 0.3:
        pytest.skip(f"other load kept {governor.other_busy_cores:.2f} cores busy after the loop ended")
    assert governor.threads == len(cpus) and applied[0] < len(cpus)


def test_restore_sets_the_starting_count_back():
    machine = ScriptedMachine({0, 1})
    governor = machine.governor(ceiling=2, current=2)
    for _ in range(GOVERNOR_AGREEING_WINDOWS):
        machine.advance(1.0, others=1.0, ours=1.0)
        governor.tick()
    assert governor.threads == 1
    governor.restore()
    assert governor.threads == 2 and machine.applied == [1, 2]


def test_an_engine_keeps_the_thread_count_the_user_set(tiny_llama):
    """The tests run with OMP_NUM_THREADS=1 (tests/conftest.py): no governor, the count stays."""
    assert governor_ceiling(torch.get_num_threads()) == torch.get_num_threads()
    engine = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
    try:
        assert (engine.thread_governor is None) == (torch.get_num_threads() == 1)
    finally:
        engine.close()


def test_a_cpu_engine_with_cores_to_give_publishes_its_thread_count(tiny_llama):
    from prometheus_client import REGISTRY

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
        off = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                  adaptive_threads=False))
        try:
            assert off.thread_governor is None
            governor = engine.thread_governor
            assert governor is not None and governor.ceiling == min(2, usable_cores())
            engine.add_request("r", "hello", SamplingParams(max_tokens=3, temperature=0.0))
            while engine.has_unfinished():
                engine.step()
            labels = engine.recorder.metrics.labels
            assert REGISTRY.get_sample_value("batchinfer:cpu_threads", labels) == governor.threads
            # without a governor the series still says how many threads the engine runs on
            assert REGISTRY.get_sample_value("batchinfer:cpu_threads", off.recorder.metrics.labels) == 2
        finally:
            engine.close()
            off.close()
    finally:
        torch.set_num_threads(before)


def test_bound_openmp_threads_keep_their_count(tiny_llama, monkeypatch):
    """With OMP_PROC_BIND (or OMP_PLACES, GOMP_CPU_AFFINITY) libgomp pins threads: no governor."""
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
        assert engine.thread_governor is None
        engine.close()
    finally:
        torch.set_num_threads(before)


def test_closing_an_engine_restores_the_count_it_lowered(tiny_llama):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
        governor = engine.thread_governor
        assert governor is not None
        governor._set_threads(1)  # as a tick would under load
        governor.threads = 1
        engine.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
