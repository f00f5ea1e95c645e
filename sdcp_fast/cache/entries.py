"""Byte layout of one log entry, shared by the Redis and etcd logs.

    kind (1 octet: 0 commit, 1 fence) || epoch (8 octets big-endian) || record

The file log wraps the same payload in a length and a checksum (see `file_log.py`).
"""

from __future__ import annotations

import struct

from .api import LogEntry
from .errors import CorruptLog

_HEAD = struct.Struct(">BQ")
KIND_CODES = {"commit": 0, "fence": 1}
KIND_NAMES = {code: name for name, code in KIND_CODES.items()}


def pack_entry(kind: str, epoch: int, record: bytes) -> bytes:
    return _HEAD.pack(KIND_CODES[kind], epoch) + bytes(record)


def unpack_entry(position: int, payload: bytes) -> LogEntry:
    if len(payload) < _HEAD.size:
        raise CorruptLog(f"entry {position} is {len(payload)} bytes")
    code, epoch = _HEAD.unpack_from(payload)
    if code not in KIND_NAMES:
        raise CorruptLog(f"entry {position} has kind {code}")
    return LogEntry(position, KIND_NAMES[code], epoch, bytes(payload[_HEAD.size:]))
