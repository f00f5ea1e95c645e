"""`KIND:ARG?key=value&key=value` specs: the part after `?` as typed keyword options.

Used by every kind of spec (loader.py); tiny:, table: and replay: know no options. Unknown
keys, repeated keys and values of the wrong type are refused with `BackendSpecError`,
naming the known keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from urllib.parse import parse_qsl

from .base import BackendSpecError


def split_options(
    arg: str, known: Mapping[str, Callable[[str], object]], what: str
) -> tuple[str, dict[str, object]]:
    """("PATH", {key: converted value}) from "PATH?key=value&...". `known` maps each key to
    the function that converts its text (int, float, str)."""
    base, _, query = arg.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise BackendSpecError(f"{what}: options must read key=value&key=value") from None
    options: dict[str, object] = {}
    for key, text in pairs:
        if key not in known:
            raise BackendSpecError(
                f"{what}: unknown option {key!r} (known: {', '.join(sorted(known)) or 'none'})"
            )
        if key in options:
            raise BackendSpecError(f"{what}: option {key!r} given twice")
        try:
            options[key] = known[key](text)
        except ValueError:
            raise BackendSpecError(f"{what}: bad value {text!r} for option {key!r}") from None
    return base, options


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not a positive integer")
    return value


def choice(*allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{text!r} is not one of {', '.join(allowed)}")
        return text

    return check
