"""Deterministic CBOR (RFC 8949 section 4.2.1) and a strict decoder for untrusted bytes.

Encoding: shortest argument heads, definite lengths, map keys sorted by the bytewise order
of their own encodings (cbor2's canonical mode sorts shorter-first, which differs for maps
with keys of mixed major types), floats in the shortest of binary16/32/64 that keeps the
value. Only the types SDCP needs are encodable: int, bytes, str, list/tuple, dict, bool,
None and float.

Decoding refuses, each with its own `DecodeError` subclass: truncated input, trailing
bytes, indefinite lengths, duplicate map keys, tags and undefined simple values, nesting
deeper than `max_depth`, more than `max_items` data items in all, and bodies over
`max_size`. Non-shortest integer heads are well-formed CBOR and are accepted (digests are
always computed over our own re-encoding).

Work is bounded by the input before anything is allocated for it: a declared string length
is checked against the bytes left, a declared array or map count against both the bytes
left (every item takes at least one byte) and the items left, so a lying head costs one
comparison, and rejection time grows linearly in the input (bench/bench_decode.py measures
the slowest rejection per input size).

`loads` first tries the decoder's fast path in C (csrc/cbor/cbor_decode.c, built with the
package; about a tenth of the Python reader's time on a proposal). It takes the shapes SDCP
uses and returns what the Python reader returns for them; everything else, every refusal
included, it hands back untouched, and the Python reader below decides. Without the
extension (a build without a C compiler) the Python reader does it all.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from . import _cbor_c
except ImportError:   # built without it: the Python reader decodes everything
    _cbor_c = None

DEFAULT_MAX_SIZE = 1 << 20  # 1 MiB: a proposal is ~0.4 KB, a long prompt a few hundred KB
DEFAULT_MAX_DEPTH = 16      # SDCP messages nest at most 4 deep (session-open.resume, contract.sampling)
DEFAULT_MAX_ITEMS = 1 << 16  # data items in one input: a session-open's inline prompt is the longest list


class DecodeError(ValueError):
    """Any refusal of untrusted CBOR input."""


class Truncated(DecodeError):
    pass


class TrailingBytes(DecodeError):
    pass


class IndefiniteLength(DecodeError):
    pass


class DuplicateKey(DecodeError):
    pass


class TooDeep(DecodeError):
    pass


class TooLarge(DecodeError):
    pass


class TooManyItems(DecodeError):
    pass


class Unsupported(DecodeError):
    """Well-formed CBOR that SDCP never uses: tags, undefined, simple values, odd map keys."""


# --------------------------------------------------------------------------- encoding


def _head(major: int, value: int) -> bytes:
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24, value))
    if value < 0x10000:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    if value < 0x10000000000000000:
        return bytes((mt | 27,)) + value.to_bytes(8, "big")
    raise ValueError(f"integer out of CBOR range: {value}")


def _encode_float(value: float) -> bytes:
    if math.isnan(value):
        return b"\xf9\x7e\x00"
    for fmt, head in (("e", 0xF9), ("f", 0xFA)):
        try:
            packed = struct.pack(">" + fmt, value)
        except OverflowError:
            continue
        if struct.unpack(">" + fmt, packed)[0] == value:
            return bytes((head,)) + packed
    return b"\xfb" + struct.pack(">d", value)


_SMALL_HEADS = [[bytes((major << 5 | n,)) for n in range(24)] for major in range(8)]
_KEY_CACHE: dict[str, bytes] = {}     # encodings of map keys seen (message member names)
_KEY_CACHE_MAX = 1024


def _encode(obj: Any, out: list[bytes]) -> None:
    # exact types first (most of a message: small ints, short strings and bytes, lists,
    # maps with string keys), then the general chain below for everything else
    kind = type(obj)
    if kind is int:
        if 0 <= obj < 24:
            out.append(_SMALL_HEADS[0][obj])
        else:
            out.append(_head(0, obj) if obj >= 0 else _head(1, -1 - obj))
    elif kind is str:
        data = obj.encode("utf-8")
        out.append(_SMALL_HEADS[3][len(data)] if len(data) < 24 else _head(3, len(data)))
        out.append(data)
    elif kind is bytes:
        out.append(_SMALL_HEADS[2][len(obj)] if len(obj) < 24 else _head(2, len(obj)))
        out.append(obj)
    elif kind is list or kind is tuple:
        out.append(_SMALL_HEADS[4][len(obj)] if len(obj) < 24 else _head(4, len(obj)))
        for item in obj:
            _encode(item, out)
    elif kind is dict:
        _encode_map(obj, out)
    else:
        _encode_any(obj, out)


def _key_bytes(key: Any) -> bytes:
    if type(key) is str:
        cached = _KEY_CACHE.get(key)
        if cached is None:
            cached = dumps(key)
            if len(_KEY_CACHE) < _KEY_CACHE_MAX:
                _KEY_CACHE[key] = cached
        return cached
    return dumps(key)


def _encode_map(obj: Mapping, out: list[bytes]) -> None:
    pairs = sorted((_key_bytes(k), dumps(v)) for k, v in obj.items())
    for a, b in zip(pairs, pairs[1:], strict=False):
        if a[0] == b[0]:
            raise ValueError("map has two keys with the same encoding")
    out.append(_head(5, len(pairs)))
    for key, value in pairs:
        out.append(key)
        out.append(value)


def _encode_any(obj: Any, out: list[bytes]) -> None:
    if obj is False:
        out.append(b"\xf4")
    elif obj is True:
        out.append(b"\xf5")
    elif obj is None:
        out.append(b"\xf6")
    elif isinstance(obj, int):
        out.append(_head(0, obj) if obj >= 0 else _head(1, -1 - obj))
    elif isinstance(obj, bytes | bytearray | memoryview):
        data = bytes(obj)
        out.append(_head(2, len(data)))
        out.append(data)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out.append(_head(3, len(data)))
        out.append(data)
    elif isinstance(obj, list | tuple):
        out.append(_head(4, len(obj)))
        for item in obj:
            _encode(item, out)
    elif isinstance(obj, Mapping):
        _encode_map(obj, out)
    elif isinstance(obj, float):
        out.append(_encode_float(obj))
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} as SDCP CBOR")


def encode_into(obj: Any, out: list[bytes]) -> None:
    """Append the deterministic encoding of `obj` to `out` (pieces; b"".join them)."""
    _encode(obj, out)


def head(major: int, value: int) -> bytes:
    """The shortest head of a data item of major type `major` with argument `value`."""
    return _SMALL_HEADS[major][value] if value < 24 else _head(major, value)


def uint_array(values: Sequence[int]) -> bytes:
    """The encoding of an array of unsigned integers (a token list) in one piece: what
    `dumps(list(values))` gives, without a call per item. Every value must be an int in
    0..2**64-1 (the caller's check)."""
    count = len(values)
    head = _SMALL_HEADS[4][count] if count < 24 else _head(4, count)
    if not values or max(values) < 24:   # each item is its own head byte
        return head + bytes(values)
    out = bytearray(head)
    for value in values:
        if value < 24:
            out.append(value)
        elif value < 0x100:
            out += bytes((24, value))
        elif value < 0x10000:
            out.append(25)
            out += value.to_bytes(2, "big")
        elif value < 0x100000000:
            out.append(26)
            out += value.to_bytes(4, "big")
        else:
            out.append(27)
            out += value.to_bytes(8, "big")
    return bytes(out)


def small_heads(major: int) -> list[bytes]:
    """The one-byte heads of major type `major`, argument 0..23 (`head(major, n)` for n < 24)."""
    return list(_SMALL_HEADS[major])


def key_bytes(key: str) -> bytes:
    """The encoding of a map key (cached for text keys)."""
    return _key_bytes(key)


def dumps(obj: Any) -> bytes:
    """Deterministic encoding (RFC 8949 section 4.2.1) of `obj`."""
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


# --------------------------------------------------------------------------- decoding


class _Reader:
    __slots__ = ("data", "pos", "max_depth", "items_left")

    def __init__(self, data: bytes, max_depth: int, max_items: int):
        self.data = data
        self.pos = 0
        self.max_depth = max_depth
        self.items_left = max_items

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise Truncated(f"needs {n} bytes at offset {self.pos}, input has {len(self.data)}")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def argument(self, info: int) -> int:
        if info < 24:
            return info
        if info == 24:
            return self.take(1)[0]
        if info == 25:
            return int.from_bytes(self.take(2), "big")
        if info == 26:
            return int.from_bytes(self.take(4), "big")
        if info == 27:
            return int.from_bytes(self.take(8), "big")
        if info == 31:
            raise IndefiniteLength(f"indefinite length at offset {self.pos - 1}")
        raise DecodeError(f"reserved additional information {info} at offset {self.pos - 1}")

    def item(self, depth: int) -> Any:
        if depth > self.max_depth:
            raise TooDeep(f"nesting deeper than {self.max_depth}")
        self.items_left -= 1
        if self.items_left < 0:
            raise TooManyItems("more data items than allowed")
        data, pos = self.data, self.pos
        if pos >= len(data):
            raise Truncated(f"needs 1 bytes at offset {pos}, input has {len(data)}")
        initial = data[pos]
        self.pos = pos + 1
        major, info = initial >> 5, initial & 0x1F
        if major == 7:
            return self.simple(info)
        value = info if info < 24 else self.argument(info)
        if major == 0:
            return value
        if major == 1:
            return -1 - value
        if major == 2:
            return self.take(value)
        if major == 3:
            try:
                return self.take(value).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DecodeError(f"text string is not UTF-8: {exc}") from None
        if major == 4:
            self.check_count(value, 1)
            return self.array(value, depth + 1)
        if major == 5:
            self.check_count(value, 2)
            return self.map(value, depth + 1)
        raise Unsupported(f"tag {value} at offset {self.pos}")

    def map(self, count: int, depth: int) -> dict[Any, Any]:
        """`count` entries. A key that is a short text string (every SDCP member name) and a
        value that is an unsigned integer or a byte or text string (shorter than 256 bytes)
        are read inline, with the same checks `item` makes (depth, items left, bounds,
        UTF-8); anything else (and every refusal) goes through `item`."""
        data, end = self.data, len(self.data)
        inline_ok = depth <= self.max_depth
        result: dict[Any, Any] = {}
        for _ in range(count):
            pos = self.pos
            head = data[pos] if pos < end else 0xFF
            key: Any = None
            if 0x60 <= head < 0x78 and inline_ok and self.items_left > 0 and pos + 1 + (head - 0x60) <= end:
                stop = pos + 1 + (head - 0x60)
                try:
                    key = data[pos + 1:stop].decode("utf-8")
                except UnicodeDecodeError:
                    key = None   # `item` raises the decoder's error for it
                else:
                    self.items_left -= 1
                    self.pos = stop
            if key is None:
                key = self.item(depth)
                if not isinstance(key, int | str | bytes):
                    raise Unsupported(f"map key of type {type(key).__name__}")
            if key in result:
                raise DuplicateKey(f"duplicate map key {_short(key)}")
            pos = self.pos
            head = data[pos] if pos < end and inline_ok and self.items_left > 0 else 0xFF
            stop = 0   # where an inline value ends (0: not inline)
            if head < 24:
                value, stop = head, pos + 1
            elif head < 28:   # an unsigned integer with a 1, 2, 4 or 8 byte argument
                stop = pos + 1 + (1 << (head - 24))
                if stop <= end:
                    value = int.from_bytes(data[pos + 1:stop], "big")
                else:
                    stop = 0
            elif 0x40 <= head <= 0x58 or 0x60 <= head <= 0x78:   # a byte or text string
                start = pos + 1
                size = head & 0x1F
                if size == 24:   # a one-byte length
                    size = data[start] if start < end else end
                    start += 1
                stop = start + size
                if stop <= end:
                    value = data[start:stop]
                    if head >= 0x60:
                        try:
                            value = value.decode("utf-8")
                        except UnicodeDecodeError:
                            stop = 0   # `item` raises the decoder's error for it
                else:
                    stop = 0
            if stop:
                self.items_left -= 1
                self.pos = stop
                result[key] = value
            else:
                result[key] = self.item(depth)
        return result

    def array(self, count: int, depth: int) -> list[Any]:
        """`count` items; unsigned integers below 2**32 (token lists, the bulk of every large
        message) are read inline, anything else through `item`."""
        if count and depth > self.max_depth:
            raise TooDeep(f"nesting deeper than {self.max_depth}")
        data, out, pos, end = self.data, [], self.pos, len(self.data)
        inline = 0
        for _ in range(count):
            if pos >= end:
                raise Truncated(f"array item at offset {pos}: input ends")
            head = data[pos]
            if head < 24:
                out.append(head)
                pos += 1
            elif 24 <= head <= 26 and pos + (1 << (head - 24)) < end:
                size = 1 << (head - 24)
                out.append(int.from_bytes(data[pos + 1:pos + 1 + size], "big"))
                pos += 1 + size
            else:
                self.pos, self.items_left = pos, self.items_left - inline
                inline = 0
                out.append(self.item(depth))
                pos = self.pos
                continue
            inline += 1
        self.pos, self.items_left = pos, self.items_left - inline
        if self.items_left < 0:  # nested items used up what the rest of this array needed
            raise TooManyItems("more data items than allowed")
        return out

    def check_count(self, count: int, per_entry: int) -> None:
        # every item takes at least one byte: a count beyond the rest is a lie; refuse it, or
        # one beyond the items still allowed, before allocating anything for it
        if count * per_entry > len(self.data) - self.pos:
            raise Truncated(f"count {count} exceeds the remaining {len(self.data) - self.pos} bytes")
        if count * per_entry > self.items_left:
            raise TooManyItems(f"count {count} exceeds the data items still allowed")

    def simple(self, info: int) -> Any:
        if info == 20:
            return False
        if info == 21:
            return True
        if info == 22:
            return None
        if info == 25:
            return struct.unpack(">e", self.take(2))[0]
        if info == 26:
            return struct.unpack(">f", self.take(4))[0]
        if info == 27:
            return struct.unpack(">d", self.take(8))[0]
        if info == 31:
            raise IndefiniteLength(f"break code at offset {self.pos - 1}")
        raise Unsupported(f"simple value {info} at offset {self.pos - 1}")


def _short(value: Any) -> str:
    """A bounded rendering of an untrusted value for an error message."""
    text = repr(value[:40] if isinstance(value, bytes | str) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def loads(data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_SIZE,
          max_depth: int = DEFAULT_MAX_DEPTH, max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """Decode exactly one CBOR item from untrusted `data`, or raise a `DecodeError`."""
    if len(data) > max_size:
        raise TooLarge(f"body of {len(data)} bytes exceeds the limit of {max_size}")
    if _cbor_c is not None:
        try:
            return _cbor_c.decode(data, max_depth, max_items)
        except _cbor_c.Fallback:   # not taken there: the Python reader gives the answer
            pass
    return python_loads(data, max_depth=max_depth, max_items=max_items)


def python_loads(data: bytes | bytearray | memoryview, *, max_depth: int = DEFAULT_MAX_DEPTH,
                 max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """`loads` by the Python reader alone (no size limit here: `loads` checks it first)."""
    reader = _Reader(bytes(data), max_depth, max_items)
    if not reader.data:
        raise Truncated("empty input")
    value = reader.item(0)
    if reader.pos != len(reader.data):
        raise TrailingBytes(f"{len(reader.data) - reader.pos} bytes after the item")
    return value
