"""Progress of a job on stderr, shared by `run` and `submit --wait`: requests done / total, tokens/s, ETA.

On a terminal it is a live rich bar; without one (cron, Airflow, CI logs) it prints one plain line every
`interval_s` seconds and a last one at the end, since a redrawn bar in a log file is either nothing or
noise. Tokens/s and the ETA are the batch object's `progress` (store.progress: tokens generated so far,
in-flight requests included, and the requests' max_tokens budgets), never rich's own estimate: the same
figures `status --json`, the REST API and the dashboard show. `submit --wait` polls them; `run` follows
them from the database its own worker heartbeats into (`follow`, a poll on a thread), while finished
requests advance the count at once (`advance`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from batchinfer.wire.batch import BatchObject

DEFAULT_UPDATE_INTERVAL_S = 30.0
FOLLOW_INTERVAL_S = 1.0  # how often `run` re-reads its batch's measured progress


def format_duration(seconds: float | None) -> str:
    """h:mm:ss, or -:--:-- when unknown."""
    if seconds is None:
        return "-:--:--"
    return str(timedelta(seconds=max(0, round(seconds))))


class JobProgress:
    """A job's progress: a bar on a terminal, else a line every `interval_s` (see the module docstring)."""

    def __init__(self, *, total: int, done: int = 0, description: str = "running", enabled: bool = True,
                 interval_s: float = DEFAULT_UPDATE_INTERVAL_S, label: str = "",
                 console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        interactive = self._console.is_terminal
        self._lines = enabled and not interactive
        self.interval_s = interval_s
        self.description, self.label = description, label
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=self._console,
            disable=not (enabled and interactive),
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, completed=done, rate="",
                                             eta=format_duration(None))
        self.total, self.done, self.tokens = total, done, 0
        self.status: str | None = None
        self.eta_seconds: float | None = None
        self.tokens_per_second: float | None = None
        self._started = time.monotonic()
        self._last_line = self._started
        self._printed: tuple[int, str | None] | None = None  # (done, status) of the last line printed
        self._lock = threading.Lock()  # `follow`'s thread and the caller's both update
        self._stop_following = threading.Event()
        self._follower: threading.Thread | None = None
        self._requests_only = False  # an embeddings batch: the rate is of input tokens

    def __enter__(self) -> JobProgress:
        self._progress.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop_following.set()
        if self._follower is not None:
            self._follower.join(timeout=5)
        self._progress.stop()
        if self._lines and self._printed != (self.done, self.status):  # the final state, once
            self._print_line()

    def advance(self, requests: int, tokens: int) -> None:
        """Count requests finished since the last call (local mode; tokens/s and ETA come from `follow`)."""
        with self._lock:
            self.done = min(self.done + requests, self.total)
            self._update()

    def set(self, *, done: int, tokens: int, total: int | None = None, eta_seconds: float | None = None,
            tokens_per_second: float | None = None, status: str | None = None) -> None:
        """Set absolute figures (polling mode: the batch object's counts and measured progress)."""
        with self._lock:
            self.done, self.tokens = max(done, self.done), tokens  # `advance` may be ahead of the database
            self.total = self.total if total is None else total
            self.eta_seconds, self.status = eta_seconds, status
            if tokens_per_second is None:
                tokens_per_second = tokens / max(time.monotonic() - self._started, 1e-6)
            self.tokens_per_second = tokens_per_second
            self._update()

    def show(self, batch: BatchObject) -> None:
        """Set the figures of a batch object: counts, generated tokens, its measured tokens/s and ETA."""
        counts, progress = batch.request_counts, batch.progress
        tokens = progress.generated_tokens
        self.set(done=counts.completed + counts.failed, total=counts.total,
                 tokens=batch.usage.output_tokens if tokens is None else tokens,
                 eta_seconds=progress.eta_seconds, tokens_per_second=progress.tokens_per_second,
                 status=batch.status)
        self._requests_only = not self.tokens and bool(progress.input_tokens_per_second)
        if self._requests_only:  # an embeddings batch generates nothing: show the inputs it read
            self.tokens_per_second = progress.input_tokens_per_second

    def follow(self, fetch: Callable[[], BatchObject], *, interval_s: float = FOLLOW_INTERVAL_S) -> None:
        """Re-read the batch object (`fetch`) every `interval_s` on a daemon thread until the bar closes."""
        def loop() -> None:
            while not self._stop_following.wait(interval_s):
                try:
                    batch = fetch()
                except Exception:  # noqa: BLE001 - a missed poll costs one refresh, never the run
                    continue
                self.show(batch)

        self._follower = threading.Thread(target=loop, name="batchinfer-progress", daemon=True)
        self._follower.start()

    def line(self) -> str:
        """The one-line update: who, status, done/total, failures aside, tokens/s, elapsed, ETA."""
        percent = f" ({100.0 * self.done / self.total:.1f}%)" if self.total else ""
        who = " ".join(part for part in (self.label, self.status or self.description) if part)
        eta = format_duration(0 if self.total and self.done >= self.total else self.eta_seconds)
        if self.eta_seconds is None and self.done < self.total:
            eta = "unknown until tokens are generated"
        return (f"{who}: {self.done}/{self.total} requests{percent}, {self._rate()}, "
                f"elapsed {format_duration(time.monotonic() - self._started)}, ETA {eta}")

    def _rate(self) -> str:
        unit = "input tok/s" if self._requests_only else "tok/s"
        return f"{self.tokens_per_second or 0.0:,.1f} {unit}"

    def _update(self) -> None:
        self._progress.update(self._task, completed=self.done, total=self.total, rate=self._rate(),
                              eta=format_duration(self.eta_seconds))
        if self._lines and time.monotonic() - self._last_line >= self.interval_s:
            self._print_line()

    def _print_line(self) -> None:
        self._last_line = time.monotonic()
        self._printed = (self.done, self.status)
        click.echo(self.line(), err=True)
