"""Typed errors of the cache layer: the verifier maps each to an SDCP outcome."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error raised by an object store or a commit log."""


class NotFound(CacheError, KeyError):
    """The object does not exist: never written, deleted, evicted, or its lease ended."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.uri = uri

    def __str__(self) -> str:
        return f"no object {self.uri!r}"


class StoreFull(CacheError):
    """The object cannot be stored: leased objects alone fill the configured capacity."""


class StoreTimeout(CacheError, TimeoutError):
    """A store or log operation did not finish within its timeout."""


class BadSpec(CacheError, ValueError):
    """An `open_store` / `open_log` spec that names no known backend or is malformed."""


class Conflict(CacheError):
    """A conditional append lost: the log is no longer `expected` records long (section 6.8)."""

    def __init__(self, current_length: int):
        super().__init__(current_length)
        self.current_length = current_length

    def __str__(self) -> str:
        return f"log changed: now {self.current_length} records long"


class Fenced(CacheError):
    """The log holds a fence record with an epoch above the writer's (sections 6.8, 6.9).

    The verifier must discard the round, release no output and stop serving the session.
    """

    def __init__(self, fence_epoch: int):
        super().__init__(fence_epoch)
        self.fence_epoch = fence_epoch

    def __str__(self) -> str:
        return f"log fenced at epoch {self.fence_epoch}"


class CorruptLog(CacheError):
    """A log record is malformed somewhere other than a torn tail (not a crash artefact)."""


class SizeMismatch(CacheError):
    """An object's size is not what the reader expected (e.g. M x V x 4 for q rows)."""

    def __init__(self, uri: str, actual: int, expected: int):
        super().__init__(uri, actual, expected)
        self.uri, self.actual, self.expected = uri, actual, expected

    def __str__(self) -> str:
        return f"object {self.uri!r} is {self.actual} bytes, expected {self.expected}"


class UnsafeDirectory(CacheError, PermissionError):
    """A store directory others could have written to: not ours, too open, or a symlink.

    The embedded store's index decides what a reader maps and reads, so its directory must
    be a real directory owned by this user that no one else can write to.
    """
