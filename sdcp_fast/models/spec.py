"""Model specs: `KIND:ARG?name=value&name=value`, as written in configs and on command lines.

    hf:/models/smol?dtype=bfloat16&device=cuda&threads=4
    hf:/wheels/SmolLM2-135M-Instruct.Q4_1.gguf
    tiny:demo-target

`parse_spec` splits a spec into kind, argument and options (strings); `spec_options` turns
the options into typed values for one kind, refusing any it does not know with the list of
those it does, so a typo never passes silently. Every kind's loader uses the same two steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from .base import BackendSpecError


@dataclass(frozen=True)
class ModelSpec:
    kind: str
    arg: str
    options: dict[str, str] = field(default_factory=dict)
    text: str = ""  # the spec as written, for messages


def parse_spec(spec: str) -> ModelSpec:
    kind, sep, rest = spec.partition(":")
    arg, _, query = rest.partition("?")
    if not sep or not kind or not arg:
        raise BackendSpecError(f"model spec must be KIND:ARG[?OPTIONS], got {spec!r}")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise BackendSpecError(f"{spec!r}: options must read name=value&name=value") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name in options:
            raise BackendSpecError(f"{spec!r}: option {name!r} given twice")
        options[name] = value
    return ModelSpec(kind, arg, options, spec)


def spec_options(spec: ModelSpec, known: Mapping[str, Callable[[str], Any]]) -> dict[str, Any]:
    """The spec's options converted by `known` (option name -> converter from the string).
    Unknown names and values a converter rejects raise `BackendSpecError`."""
    unknown = sorted(set(spec.options) - set(known))
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise BackendSpecError(
            f"{spec.text!r}: unknown option(s) {', '.join(unknown)} for {spec.kind}: "
            f"(known: {listed})"
        )
    out = {}
    for name, value in spec.options.items():
        try:
            out[name] = known[name](value)
        except (TypeError, ValueError) as e:
            raise BackendSpecError(f"{spec.text!r}: bad value for {name}: {e}") from None
    return out


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
