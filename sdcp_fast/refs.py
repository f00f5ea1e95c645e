"""Names and encodings the roles share, so that each is written once.

- Ids in resource paths: a session id is the base64url of its 16 bytes
  (`sessions/{sid}/...`), an instance id the base64url of its base URI
  (`instances/{iid}/status`); both without padding.
- Cache objects the roles name (all under the contract's KVSP scope when it has one):
  committed tokens a router hands to a verifier or drafter, the target KV a verifier
  publishes for failover, the draft KV a drafter publishes for its successor, and the q rows
  of one proposal. The commit log of a session is named by `commit_log_name`.
- Prompts and committed tokens behind a cache reference are a CBOR array of token ids.
- A contract in a text record (the router's session table) is the hex of its
  deterministic CBOR (`contract_text`, `contract_from_text`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from .cache import NotFound, object_uri
from .core import cbor
from .core.messages import Contract
from .core.problems import Kind, problem

MAX_TOKEN_LIST_BYTES = 64 << 20
SESSION_ID_BYTES = 16


# ---------------------------------------------------------------------- ids in paths

def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64url(text: str) -> bytes | None:
    if "=" in text:
        return None
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None


def encode_session_id(session: bytes) -> str:
    return _b64url(session)


def decode_session_id(text: str) -> bytes:
    """The 16-byte session id of a path segment; 404 for anything else."""
    raw = _unb64url(text)
    if raw is None or len(raw) != SESSION_ID_BYTES:
        raise problem(Kind.NOT_FOUND, f"{text!r} is not a base64url session id")
    return raw


def encode_instance_id(uri: str) -> str:
    return _b64url(uri.encode())


def decode_instance_id(text: str) -> str:
    """The instance URI of a path segment; 404 for anything else."""
    raw = _unb64url(text)
    try:
        if raw is None:
            raise ValueError
        return raw.decode()
    except (UnicodeDecodeError, ValueError):
        raise problem(Kind.NOT_FOUND, f"{text!r} is not a base64url instance id") from None


# ---------------------------------------------------------------------- cache objects

def commit_log_name(session: bytes) -> str:
    return f"log/{session.hex()}"


def committed_tokens_ref(session: bytes, epoch: int, count: int, scope: bytes | None) -> str:
    return object_uri(f"committed/{session.hex()}/{epoch}/{count}", scope)


def target_kv_ref(session: bytes, scope: bytes | None = None) -> str:
    """Where a verifier publishes a session's target KV (a router offers it on resume)."""
    return object_uri(f"target-kv/{session.hex()}", scope)


def draft_kv_ref(session: bytes, scope: bytes | None = None) -> str:
    """Where a drafter publishes a session's draft KV (a successor drafter imports it)."""
    return object_uri(f"draft-kv/{session.hex()}", scope)


def q_rows_ref(session: bytes, epoch: int, round: int, seq: int, scope: bytes | None) -> str:
    """The [M, V] fp32 q rows of one proposal (`seq` tells rebuilt proposals apart)."""
    return object_uri(f"q/{session.hex()}/{epoch}/{round}/{seq}", scope)


# ---------------------------------------------------------------------- token lists

def token_list_bytes(tokens: Sequence[int]) -> bytes:
    """How prompts and committed tokens are stored behind a cache reference."""
    return cbor.dumps(list(tokens))


def token_list_from_bytes(data: bytes, what: str) -> tuple[int, ...]:
    try:
        tokens = cbor.loads(data, max_size=MAX_TOKEN_LIST_BYTES, max_items=MAX_TOKEN_LIST_BYTES)
    except cbor.DecodeError as exc:
        raise problem(Kind.BAD_REQUEST, f"{what} object is not a CBOR token list: {exc}") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
        raise problem(Kind.BAD_REQUEST, f"{what} object is not a list of token ids")
    return tuple(tokens)


async def read_token_list(store, ref_or_tokens: str | tuple[int, ...], what: str) -> tuple[int, ...]:
    """Tokens given inline, or read from the cache (409 when the object is not there)."""
    if isinstance(ref_or_tokens, tuple):
        return ref_or_tokens
    try:
        data = await store.get(ref_or_tokens)
    except NotFound:
        raise problem(Kind.CONFLICT, f"{what} {ref_or_tokens!r} is not in the cache") from None
    return token_list_from_bytes(data, what)


# ---------------------------------------------------------------------- contracts in text

def contract_text(contract: Contract) -> str:
    """The contract as a text record holds it: the hex of its deterministic CBOR."""
    return contract.cbor.hex()


def contract_from_text(text: str) -> Contract:
    """The contract of `contract_text` (validated as any received contract)."""
    return Contract.from_cbor(bytes.fromhex(text))
