"""Progress of a job on stderr, shared by `run` and `submit --wait`: requests done / total, tokens/s, ETA.

On a terminal it is a live rich bar; without one (cron, Airflow, CI logs) it prints one plain line every
`interval_s` seconds and a last one at the end, since a redrawn bar in a log file is either nothing or
noise. The ETA is measured throughput, never rich's own estimate: rich averages the last 30 seconds of
updates, and requests of a long generation finish minutes apart, so it read `-:--:--` for most of a run.
Locally (`run`) it is measured here from the bar's start; when polling (`submit --wait`) it is the batch
object's `progress.eta_seconds`, measured by the store from the first shard claim (store.serialize).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

DEFAULT_UPDATE_INTERVAL_S = 30.0


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
        self._done_at_start = done
        self._started = time.monotonic()
        self._last_line = self._started
        self._printed: tuple[int, str | None] | None = None  # (done, status) of the last line printed

    def __enter__(self) -> JobProgress:
        self._progress.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._progress.stop()
        if self._lines and self._printed != (self.done, self.status):  # the final state, once
            self._print_line()

    def advance(self, requests: int, tokens: int) -> None:
        """Count requests finished and tokens generated since the last call (local mode: measured here)."""
        from batchinfer.store.serialize import estimate_eta_seconds  # the one ETA rule, shared with REST

        self.done += requests
        self.tokens += tokens
        elapsed = max(time.monotonic() - self._started, 1e-6)
        self.tokens_per_second = self.tokens / elapsed
        self.eta_seconds = estimate_eta_seconds(done=self.done - self._done_at_start,
                                                remaining=self.total - self.done, elapsed_s=elapsed)
        self._update()

    def set(self, *, done: int, tokens: int, total: int | None = None, eta_seconds: float | None = None,
            tokens_per_second: float | None = None, status: str | None = None) -> None:
        """Set absolute figures (polling mode: the batch object's counts and measured progress)."""
        self.done, self.tokens = done, tokens
        self.total = self.total if total is None else total
        self.eta_seconds, self.status = eta_seconds, status
        if tokens_per_second is None:
            tokens_per_second = tokens / max(time.monotonic() - self._started, 1e-6)
        self.tokens_per_second = tokens_per_second
        self._update()

    def line(self) -> str:
        """The one-line update: who, status, done/total, failures aside, tokens/s, elapsed, ETA."""
        percent = f" ({100.0 * self.done / self.total:.1f}%)" if self.total else ""
        who = " ".join(part for part in (self.label, self.status or self.description) if part)
        eta = format_duration(0 if self.total and self.done >= self.total else self.eta_seconds)
        if self.eta_seconds is None and self.done < self.total:
            eta = "unknown until requests finish"
        return (f"{who}: {self.done}/{self.total} requests{percent}, {self.tokens_per_second or 0.0:,.1f} "
                f"tok/s, elapsed {format_duration(time.monotonic() - self._started)}, ETA {eta}")

    def _update(self) -> None:
        self._progress.update(self._task, completed=self.done, total=self.total,
                              rate=f"{self.tokens_per_second or 0.0:,.1f} tok/s",
                              eta=format_duration(self.eta_seconds))
        if self._lines and time.monotonic() - self._last_line >= self.interval_s:
            self._print_line()

    def _print_line(self) -> None:
        self._last_line = time.monotonic()
        self._printed = (self.done, self.status)
        click.echo(self.line(), err=True)
