"""How the ranks of a parallel engine start as local processes, from any script, and fail fast.

Spawned, never forked: a forked rank hangs in its first parallel torch op when the parent has already run
an OpenMP region (GNU libgomp is not fork-safe; measured here with two threads), and a fork breaks CUDA.
Spawn, though, re-runs the parent's main script in every child to find the objects it unpickles, so a
plain script (no `if __name__ == "__main__":`) builds its LLM again inside each rank and dies with
multiprocessing's bootstrapping error. A rank's target and arguments all live in batchinfer's modules,
so spawn_rank hides the main script from the child while starting it: a plain script works like a
guarded one, and no script runs twice.

A rank that dies while starting is reported at once: wait_started watches each child's sentinel beside
its start signal, so rank 0 never sits out the rendezvous timeout waiting for a dead peer.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event

from batchinfer.engine.errors import RankFailedError

CONTEXT = mp.get_context("spawn")


@dataclass
class RankProcess:
    """A started rank process and the event it sets once it runs its target."""

    process: SpawnProcess
    started: Event


def spawn_rank(name: str, target: Callable[..., None], args: tuple[object, ...]) -> RankProcess:
    """Start target(*args) in a daemonic spawned process named `name`, without re-running __main__."""
    started = CONTEXT.Event()
    process = CONTEXT.Process(target=_run_rank, args=(started, target, args), name=name, daemon=True)
    with _main_script_hidden():
        process.start()
    return RankProcess(process, started)


def wait_started(ranks: list[RankProcess], *, what: str) -> None:
    """Return once every rank runs its target; RankFailedError naming those that exited first."""
    pending = list(ranks)
    while pending := [rank for rank in pending if not rank.started.is_set()]:
        dead = [rank.process for rank in pending if not rank.process.is_alive()]
        if dead:
            who = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
            raise RankFailedError(f"{what}: {who} exited while starting; see its error above")
        wait([rank.process.sentinel for rank in pending], timeout=0.05)


def _run_rank(started: Event, target: Callable[..., None], args: tuple[object, ...]) -> None:
    started.set()
    target(*args)


@contextmanager
def _main_script_hidden() -> Iterator[None]:
    """While a child starts, __main__ names no file or module, so spawn imports nothing of it there.

    multiprocessing reads __main__.__spec__ (a `python -m` run) or __main__.__file__ (a script) when it
    prepares a child, before start() returns; the interactive interpreter has neither.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, object] = {
        key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    if "__spec__" in saved:
        main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
