"""The poll caches (authenticated keys, polled batch objects): cachetools' TTLCache with refresh-ahead.

An entry lives ttl_s (cachetools expires and evicts it). Past half its life, `refresh_due` says yes
once, so the caller can re-read it in the background while still answering from the cache: steadily
polled entries never make a request wait for the database, and none is ever older than ttl_s.
The event loop and the threadpool share one cache, so every access holds its lock (cachetools'
caches are not thread-safe); each one is a dict operation or two.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Generic, TypeVar

from cachetools import TTLCache

V = TypeVar("V")


class PollCache(Generic[V]):
    """A time-bounded memo (monotonic clock) that asks for one background refresh past half-life."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        # value = (refresh-after time, cached value); ttl_s <= 0 disables the cache (puts are dropped)
        self._entries: TTLCache[Hashable, tuple[float, V]] | None = (
            TTLCache(maxsize=max_entries, ttl=ttl_s, timer=time.monotonic) if ttl_s > 0 else None)
        self._refreshing: set[Hashable] = set()

    def get(self, key: Hashable) -> V | None:
        """The value stored under `key` less than ttl_s ago, else None."""
        if self._entries is None:
            return None
        with self._lock:
            entry = self._entries.get(key)
        return entry[1] if entry is not None else None

    def refresh_due(self, key: Hashable) -> bool:
        """True (once, until the next put or drop) when a live entry is past half its life."""
        if self._entries is None:
            return False
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or key in self._refreshing or time.monotonic() < entry[0]:
                return False
            self._refreshing.add(key)
            return True

    def put(self, key: Hashable, value: V) -> None:
        """Remember `value` for ttl_s (a no-op when the cache is disabled)."""
        with self._lock:
            self._refreshing.discard(key)
            if self._entries is not None:
                self._entries[key] = (time.monotonic() + self.ttl_s / 2, value)

    def drop(self, key: Hashable) -> None:
        """Forget `key` (after a change made through this process, or a failed refresh)."""
        with self._lock:
            self._refreshing.discard(key)
            if self._entries is not None:
                self._entries.pop(key, None)
