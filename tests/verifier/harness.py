"""A verifier on real stores (embedded object store, file commit log) with the table model,
driven through its Handler in-process; the network tests reuse the same pieces."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sdcp_fast.cache import open_log, open_store
from sdcp_fast.core.messages import (
    Action,
    Assignment,
    Contract,
    Proposal,
    Sampling,
    SessionOpen,
    Status,
)
from sdcp_fast.models import load_backend
from sdcp_fast.models.table import write_table
from sdcp_fast.refs import encode_session_id
from sdcp_fast.transport import Request
from sdcp_fast.transport.http import dispatch
from sdcp_fast.verifier import EngineConfig, VerifierConfig, VerifierService

ROUTER = "https://router.test/"
DRAFTER = "https://drafter-1.test/"
VERIFIER = "https://verifier-1.test/"
V = 16


def make_table(path: Path, vocab: int = V, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    write_table(path, torch.randn(vocab, vocab, generator=g) * 2)
    return path


def contract_for(backend, **overrides) -> Contract:
    fields = dict(target=backend.digest, tokenizer=backend.tokenizer_digest, rule=1, m_max=8,
                  max_new=40, stop=(), low_rounds=3, fallback=(Action.REDUCE, Action.SWITCH))
    fields.update(overrides)
    return Contract(**fields)


@dataclass
class Harness:
    service: VerifierService
    backend: object
    store: object
    log: object
    workdir: Path
    counter: int = field(default=0)

    @classmethod
    async def start(cls, workdir: Path, *, batching: bool = True, table_seed: int = 0, vocab: int = V,
                    output_wait_s: float = 0.5, backend=None, engine_config: EngineConfig | None = None,
                    **config_options) -> Harness:
        """A verifier over the table model (or `backend`) with `engine_config` (default:
        `batching`, a 1 ms wait for company); `config_options` go to its VerifierConfig."""
        if backend is None:
            table = make_table(workdir / "table.safetensors", vocab=vocab, seed=table_seed)
            backend = load_backend(f"table:{table}")
        store = await open_store(f"embedded:{workdir / 'mlc'}")
        log = await open_log(f"file:{workdir / 'log'}")
        config = VerifierConfig(uri=VERIFIER, routers=frozenset({ROUTER}), output_wait_s=output_wait_s,
                                **config_options)
        service = VerifierService(config, backend, store, log, engine_config=engine_config
                                  or EngineConfig(batching=batching, max_wait_ms=1.0))
        await service.start()
        return cls(service, backend, store, log, workdir)

    async def close(self) -> None:
        await self.service.stop()
        await self.store.close()
        await self.log.close()

    async def call(self, method, path, body=b"", caller=ROUTER, query=None, content_type="application/sdcp+cbor"):
        return await dispatch(self.service, Request(method, path, query or {}, content_type, body, caller))

    def new_session_id(self) -> bytes:
        self.counter += 1
        return self.counter.to_bytes(2, "big") + os.urandom(14)

    async def open(self, contract, prompt=(1, 2, 3), epoch=1, sid=None, resume=None):
        sid = sid or self.new_session_id()
        msg = SessionOpen(sid, epoch, contract, tuple(prompt), f"log/{sid.hex()}", resume=resume)
        return sid, await self.call("POST", "/sessions", msg.to_cbor())

    async def assign(self, sid, contract, state, drafter=DRAFTER, m_init=4, epoch=1):
        msg = Assignment(sid, epoch, contract, VERIFIER, drafter, (1, 2, 3), state.round,
                         state.committed, state.digest, m_init)
        return await self.call("PUT", f"/sessions/{encode_session_id(sid)}/drafter", msg.to_cbor())

    async def propose(self, sid, state, tokens, *, drafter=DRAFTER, q_rows=None, epoch=1, round=None):
        msg = Proposal(sid, epoch, state.round + 1 if round is None else round, drafter,
                       state.committed, state.digest, tuple(tokens), Status(drafter, 1, 0, 0, 1000),
                       q_rows=q_rows)
        return await self.call("POST", "/proposals", msg.to_cbor(), caller=drafter)


def harness_test(fn=None, *, timeout: float = 60.0, **start_options):
    """Turn `async def test_x(h: Harness)` into a plain test that runs it on a fresh harness
    in its own event loop, with a timeout so that nothing can hang."""

    def decorate(fn):
        def test(tmp_path):
            async def main():
                h = await Harness.start(tmp_path, **start_options)
                try:
                    await fn(h)
                finally:
                    await h.close()
            asyncio.run(asyncio.wait_for(main(), timeout))
        test.__name__ = fn.__name__
        test.__doc__ = fn.__doc__
        return test

    return decorate(fn) if fn is not None else decorate


__all__ = ["DRAFTER", "ROUTER", "VERIFIER", "Harness", "Sampling", "contract_for"]
