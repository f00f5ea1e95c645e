"""Shared test fixtures. The known-answer vectors are read from ../shared at test time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
VECTORS_PATH = SHARED / "vectors" / "sdcp-vectors.json"


def _unhex(value):
    if isinstance(value, dict) and set(value) == {"hex"}:
        return bytes.fromhex(value["hex"])
    if isinstance(value, dict):
        return {k: _unhex(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unhex(v) for v in value]
    return value


def load_vectors() -> dict:
    """The shared vectors with {"hex": ...} turned into bytes. A missing file fails loudly."""
    if not VECTORS_PATH.is_file():
        raise FileNotFoundError(f"known-answer vectors missing: {VECTORS_PATH} (../shared must be beside the repo)")
    return _unhex(json.loads(VECTORS_PATH.read_text()))


@pytest.fixture(scope="session")
def vectors() -> dict:
    return load_vectors()
