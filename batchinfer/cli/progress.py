"""The rich progress bar shared by `run` and `submit --wait`: requests done / total, tokens/s, ETA."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class JobProgress:
    """A progress bar over a job's requests, with generated tokens per second."""

    def __init__(self, *, total: int, done: int = 0, description: str = "running", enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, completed=done, rate="")
        self._tokens = 0
        self._started = time.monotonic()

    def __enter__(self) -> JobProgress:
        self._progress.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._progress.stop()

    def advance(self, requests: int, tokens: int) -> None:
        """Count requests finished and tokens generated since the last call."""
        self._tokens += tokens
        self._progress.update(self._task, advance=requests, rate=self._rate())

    def set(self, *, done: int, tokens: int, total: int | None = None) -> None:
        """Set absolute figures (polling mode)."""
        self._tokens = tokens
        self._progress.update(self._task, completed=done, total=total, rate=self._rate())

    def _rate(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        return f"{self._tokens / elapsed:,.1f} tok/s"
