"""sdcp-fast: reference implementation of the Speculative Decoding Coordination Protocol.

The stable public API for people writing their own drafter or verifier:

    deterministic_cbor(obj) -> bytes
    contract_digest(contract: Mapping) -> bytes         (validates first; raises on a bad contract)
    prefix_digest(contract_digest: bytes, prompt: Sequence[int]) -> bytes      (d[0])
    extend_digest(digest: bytes, tokens: Sequence[int]) -> bytes   (digest after all tokens)
    verify_uniform(seed: int, session: bytes, round: int, i: int, purpose: int) -> float

Everything else lives in `sdcp_fast.core` (messages, session state machine, control),
`sdcp_fast.kernels` (verify ops) and the role packages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .core.cbor import dumps as deterministic_cbor
from .core.digest import extend_digest, prefix_digest
from .core.messages import Contract
from .core.problems import ProblemError
from .core.rng import verify_uniform

__all__ = [
    "ProblemError",
    "contract_digest",
    "deterministic_cbor",
    "extend_digest",
    "prefix_digest",
    "verify_uniform",
]
__version__ = "0.1.0"


def contract_digest(contract: Mapping[str, Any]) -> bytes:
    """SHA-256("SDCP-CONTRACT-1" || 0x00 || deterministic_cbor(contract)) of a valid contract.

    Raises `ProblemError` (sdcp-bad-contract) when the contract breaks the draft's rules.
    """
    return Contract.from_obj(contract).digest
