"""The verifier's random values (draft section 6.4; ../shared/spec/NOTES.md).

With a seed in the sampling profile, each value is HMAC-SHA-256 keyed with the seed as eight
octets (network byte order) over "SDCP-VERIFY-1" || 0x00 || session || uint32(round) ||
uint32(i) || uint8(purpose); the value is the first 53 bits of the MAC divided by 2**53.
Without a seed, values come from the operating system's CSPRNG.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable

from .digest import uint32

VERIFY_DOMAIN = b"SDCP-VERIFY-1\x00"
PURPOSE_ACCEPT = 0  # the acceptance test at position i
PURPOSE_DRAW = 1    # drawing the additional (or a self-decoded) token
_SCALE = 1.0 / (1 << 53)


def verify_uniform(seed: int, session: bytes, round: int, i: int, purpose: int) -> float:
    """The verifier's uniform in [0, 1) for (round, position i, purpose), keyed by `seed`."""
    if not 0 <= seed < 1 << 64:
        raise ValueError("seed must fit in 64 bits")
    if len(session) != 16:
        raise ValueError("session id must be 16 bytes")
    if purpose not in (PURPOSE_ACCEPT, PURPOSE_DRAW):
        raise ValueError("purpose must be 0 or 1")
    message = VERIFY_DOMAIN + session + uint32(round) + uint32(i) + bytes((purpose,))
    mac = hmac.new(seed.to_bytes(8, "big"), message, hashlib.sha256).digest()
    return (int.from_bytes(mac[:8], "big") >> 11) * _SCALE


def csprng_uniform() -> float:
    """A uniform in [0, 1) with 53 random bits from the OS CSPRNG (no seed in the profile)."""
    return secrets.randbits(53) * _SCALE


UniformSource = Callable[[int, int, int], float]  # (round, i, purpose) -> u


def uniform_source(seed: int | None, session: bytes) -> UniformSource:
    """Seeded HMAC values when the profile has a seed, otherwise the CSPRNG."""
    if seed is None:
        return lambda round, i, purpose: csprng_uniform()
    return lambda round, i, purpose: verify_uniform(seed, session, round, i, purpose)


def round_uniforms(source: UniformSource, round: int, m: int) -> tuple[list[float], list[float]]:
    """Acceptance uniforms for positions 1..M (purpose 0) and the uniform for each possible
    additional-token position a+1 in 1..M+1 (purpose 1), as one tuple per round.

    The additional token's position is not known until acceptance ends, so all M+1 draw
    uniforms are derived up front; the kernels pick the one at a+1.
    """
    accept = [source(round, i, PURPOSE_ACCEPT) for i in range(1, m + 1)]
    draws = [source(round, i, PURPOSE_DRAW) for i in range(1, m + 2)]
    return accept, draws
