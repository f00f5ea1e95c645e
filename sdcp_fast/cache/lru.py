"""A bounded, thread-safe map that forgets its least recently used entries.

The commit logs cache a little per log (how far it was scanned or checked, the length and
fence last seen) to save a read per append. Every such entry can be rebuilt from the log
itself, so a cap costs at worst one extra read for a session that comes back; without one,
a long-lived verifier would keep an entry for every session it ever served.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_MAX_LOGS = 4096  # sessions a process keeps per-log state for


class LruCache(Generic[K, V]):
    """At most `max_entries` entries; `get` and `put` make an entry the most recent."""

    def __init__(self, max_entries: int = DEFAULT_MAX_LOGS):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()  # the file log updates it from worker threads

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                return default
            self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
