"""Contract digest and the committed-prefix digest chain (draft sections 4.1 and 4.2)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

CONTRACT_DOMAIN = b"SDCP-CONTRACT-1\x00"
PREFIX_DOMAIN = b"SDCP-PREFIX-1\x00"
UINT32_MAX = 0xFFFFFFFF


def uint32(value: int) -> bytes:
    """Four octets, network byte order; tokens and rounds outside that range cannot be digested."""
    if not 0 <= value <= UINT32_MAX:
        raise ValueError(f"{value} does not fit in uint32")
    return value.to_bytes(4, "big")


def contract_digest_of_encoding(contract_cbor: bytes) -> bytes:
    """SHA-256 over the domain separator and the contract's deterministic encoding."""
    return hashlib.sha256(CONTRACT_DOMAIN + contract_cbor).digest()


def prefix_digest(contract_digest: bytes, prompt: Sequence[int]) -> bytes:
    """d[0] = SHA-256("SDCP-PREFIX-1" || 0x00 || contract_digest || uint32(P) || uint32(t[0..P-1]))."""
    if len(contract_digest) != 32:
        raise ValueError("contract digest must be 32 bytes")
    h = hashlib.sha256(PREFIX_DOMAIN)
    h.update(contract_digest)
    h.update(uint32(len(prompt)))
    h.update(b"".join(uint32(t) for t in prompt))
    return h.digest()


def extend_digest(digest: bytes, tokens: Iterable[int]) -> bytes:
    """d[k] = SHA-256(d[k-1] || uint32(o[k])), applied for each token in turn."""
    if len(digest) != 32:
        raise ValueError("digest must be 32 bytes")
    sha256 = hashlib.sha256
    for token in tokens:   # uint32(token) inline: one call fewer per committed token
        if not 0 <= token <= UINT32_MAX:
            raise ValueError(f"{token} does not fit in uint32")
        digest = sha256(digest + token.to_bytes(4, "big")).digest()
    return digest


def chain(d0: bytes, output: Sequence[int]) -> list[bytes]:
    """[d[0], d[1], ..., d[n]] for committed output o[1..n]."""
    digests = [d0]
    for token in output:
        digests.append(extend_digest(digests[-1], (token,)))
    return digests


def message_fingerprint(message) -> str:
    """A short name for one message (the first 16 hex digits of SHA-256 over its
    deterministic CBOR): the drafter's round log names each verdict by it."""
    return hashlib.sha256(message.to_cbor()).hexdigest()[:16]
