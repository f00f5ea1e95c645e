"""The self-describing byte format of an exported session (cache tier, failover).

    magic  b"SDCPKV1\\n"
    u32    header length (big-endian), then the header: canonical JSON with
           backend, model_digest (hex), vocab_size, committed (token list),
           kv_tokens (how many leading committed tokens the K/V covers),
           kv_shape, kv_dtype ("float32", "bfloat16" or "float16", the backend's own;
           shape [] and kv_tokens 0 when no K/V is carried)
    bytes  the K/V tensor, C order, little-endian
    32 B   SHA-256 of everything above (detects truncation and corruption)

Import refuses a blob whose model digest differs from the importing backend's: K/V from
another model would silently produce wrong logits.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import KVImportError, SessionExists, check_tokens

MAGIC = b"SDCPKV1\n"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SessionBlob:
    backend: str
    model_digest: bytes
    vocab_size: int
    committed: list[int]
    kv_tokens: int
    kv: torch.Tensor | None  # [n_layer, 2, H, kv_tokens, Dh] ("tiny", "hf"); None otherwise


def pack(
    backend: str,
    model_digest: bytes,
    vocab_size: int,
    committed: Sequence[int],
    kv: torch.Tensor | None,
    kv_tokens: int,
) -> bytes:
    kv_bytes = b""
    shape: list[int] = []
    dtype = "float32"
    if kv is not None:
        if kv.dtype not in DTYPES.values():
            kv = kv.to(torch.float32)
        kv = kv.detach().cpu().contiguous()
        dtype = str(kv.dtype).removeprefix("torch.")
        shape = list(kv.shape)
        kv_bytes = kv.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "backend": backend,
            "model_digest": model_digest.hex(),
            "vocab_size": vocab_size,
            "committed": [int(t) for t in committed],
            "kv_tokens": kv_tokens,
            "kv_shape": shape,
            "kv_dtype": dtype,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    body = MAGIC + struct.pack(">I", len(header)) + header + kv_bytes
    return body + hashlib.sha256(body).digest()


def unpack(data: bytes, *, backend: str, model_digest: bytes) -> SessionBlob:
    if len(data) < len(MAGIC) + 4 + 32 or not data.startswith(MAGIC):
        raise KVImportError("not an SDCP KV blob (bad magic or too short)")
    body, check = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != check:
        raise KVImportError("KV blob checksum mismatch (truncated or corrupt)")
    (hlen,) = struct.unpack(">I", body[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start : start + hlen])
    except ValueError as e:
        raise KVImportError(f"KV blob header is not JSON: {e}") from None
    if header.get("backend") != backend:
        raise KVImportError(f"KV blob is for backend {header.get('backend')!r}, not {backend!r}")
    if header.get("model_digest") != model_digest.hex():
        raise KVImportError(
            f"KV blob is from another model (digest {header.get('model_digest')}, "
            f"this model {model_digest.hex()})"
        )
    committed = header["committed"]
    kv_tokens = header["kv_tokens"]
    if not 0 <= kv_tokens <= len(committed):
        raise KVImportError("KV blob covers more tokens than its committed sequence")
    payload = body[start + hlen :]
    kv = None
    shape = header["kv_shape"]
    if shape:
        dtype = DTYPES.get(header.get("kv_dtype"))
        if dtype is None:
            raise KVImportError(f"KV blob has an unknown kv_dtype {header.get('kv_dtype')!r}")
        n = 1
        for s in shape:
            n *= s
        size = n * dtype.itemsize
        if len(payload) != size:
            raise KVImportError(f"KV payload is {len(payload)} bytes, header says {size}")
        kv = torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape)
    elif payload:
        raise KVImportError("KV blob carries a payload but no shape")
    return SessionBlob(backend, model_digest, header["vocab_size"], committed, kv_tokens, kv)


def unpack_for(backend, session: bytes, data: bytes) -> tuple[SessionBlob, list[int]]:
    """What every backend checks before importing a session's blob: the session id is free,
    the blob is this backend's and this model's, and its committed tokens are valid and fit
    the backend's length cap (`backend._check_length`). Returns the blob and those tokens."""
    if session in backend._sessions:
        raise SessionExists(f"session {session!r} is already open")
    blob = unpack(data, backend=backend.kind, model_digest=backend.digest)
    committed = check_tokens(blob.committed, backend.vocab_size, "imported committed")
    if not committed:
        raise KVImportError("imported session has an empty committed sequence")
    backend._check_length(len(committed))
    return blob, committed
