"""Uniforms derived as the draft's HMAC (../shared/spec/NOTES.md, "Numbers and encodings"),
implemented here with hmac/hashlib so the kernels are checked on the real derivation without
depending on sdcp_fast.core."""

import hashlib
import hmac
import json
import struct
from pathlib import Path

import torch
from kernel_cases import assert_matches_reference, random_logits, random_q
from sdcp_fast.kernels import ProposalInput, build_batch, verify

VECTORS = Path("/work/shared/vectors/sdcp-vectors.json")


def uniform(seed: int, session: bytes, round_: int, i: int, purpose: int) -> float:
    msg = b"SDCP-VERIFY-1\x00" + session + struct.pack(">IIB", round_, i, purpose)
    mac = hmac.new(seed.to_bytes(8, "big"), msg, hashlib.sha256).digest()
    return (int.from_bytes(mac[:8], "big") >> 11) / 2**53


def test_local_derivation_matches_vectors():
    cases = json.loads(VECTORS.read_text())["uniforms"]
    assert cases
    for c in cases:
        got = uniform(c["seed"], bytes.fromhex(c["session"]), c["round"], c["i"], c["purpose"])
        assert got == c["u"], c


def test_verify_with_hmac_uniforms(target):
    """Acceptance at position i uses (round, i, 0); the extra token (round, a + 1, 1): the
    batch carries purpose-1 values for every i = 1..M+1 and the op picks the one at a + 1."""
    device, impl = target
    gen = torch.Generator().manual_seed(2)
    seed, session, round_ = 0x0123456789ABCDEF, bytes(range(16)), 41
    vocab, ms = 400, [4, 2, 6, 3]
    logits = random_logits(gen, sum(m + 1 for m in ms), vocab, torch.bfloat16)
    props, q_rows, row = [], [], 0
    for m in ms:
        q = random_q(gen, m, vocab, logits[row: row + m])
        q_rows.append(q)
        props.append(ProposalInput(
            rule=2, tokens=torch.multinomial(q.double(), 1, generator=gen)[:, 0].tolist(),
            accept_uniforms=[uniform(seed, session, round_, i, 0) for i in range(1, m + 1)],
            extra_uniforms=[uniform(seed, session, round_, i, 1) for i in range(1, m + 2)],
            sampling={"temperature_milli": 800, "top_p_milli": 950}))
        row += m + 1
    batch = build_batch(logits.to(device), props, torch.cat(q_rows).to(device))
    got = verify(batch, path=impl)
    assert_matches_reference(batch, got)
