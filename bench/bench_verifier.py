"""Verifier throughput with cross-session batching against batching switched off.

    python bench/bench_verifier.py [--model tiny:demo-target] [--sessions 64] [--rounds 8] [--m 4]

S sessions propose concurrently through the verifier's Handler (in process: this measures
the engine, not the transport) on the embedded store and a file commit log. Each drafter
proposes M random tokens per round (so nearly every round commits one token: the figure
is the verifier's cost per proposed token, independent of draft quality). Both
configurations run side by side in one process on the same inputs;
the script prints verified proposal tokens per second, committed tokens per second, and the
ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast.cache import open_log, open_store  # noqa: E402
from sdcp_fast.core.messages import (  # noqa: E402
    Action,
    Assignment,
    Contract,
    Proposal,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.refs import encode_session_id  # noqa
from sdcp_fast.transport import Request  # noqa: E402
from sdcp_fast.transport.http import dispatch  # noqa: E402
from sdcp_fast.verifier import EngineConfig, VerifierConfig, VerifierService  # noqa: E402

ROUTER, DRAFTER, VERIFIER = "https://router/", "https://drafter/", "https://verifier/"


async def run(model: str, sessions: int, rounds: int, m: int, batching: bool, workdir: Path) -> dict:
    backend = load_backend(model)
    store = await open_store(f"embedded:{workdir / 'mlc'}")
    log = await open_log(f"file:{workdir / 'log'}")
    service = VerifierService(VerifierConfig(VERIFIER, frozenset({ROUTER})), backend, store, log,
                              engine_config=EngineConfig(batching=batching, max_batch=64, max_wait_ms=2.0))
    await service.start()
    contract = Contract(target=backend.digest, tokenizer=backend.tokenizer_digest, rule=1, m_max=16,
                        max_new=rounds * (m + 1), stop=(), low_rounds=10_000, fallback=(Action.REDUCE,))
    rng = random.Random(0)

    async def call(method, path, body, caller):
        return await dispatch(service, Request(method, path, {}, "application/sdcp+cbor", body, caller))

    async def one_session(n: int) -> tuple[int, int]:
        sid = n.to_bytes(16, "big")
        prompt = tuple(rng.randrange(backend.vocab_size) for _ in range(16))
        r = await call("POST", "/sessions", SessionOpen(sid, 1, contract, prompt, f"log/{n}").to_cbor(), ROUTER)
        state = SessionState.from_cbor(r.body)
        a = Assignment(sid, 1, contract, VERIFIER, DRAFTER, prompt, 0, 0, state.digest, m)
        await call("PUT", f"/sessions/{encode_session_id(sid)}/drafter", a.to_cbor(), ROUTER)
        verified = committed = 0
        for _ in range(rounds):
            tokens = tuple(rng.randrange(backend.vocab_size) for _ in range(m))
            p = Proposal(sid, 1, state.round + 1, DRAFTER, state.committed, state.digest, tokens,
                         Status(DRAFTER, 1, 0, 0, 1000))
            r = await call("POST", "/proposals", p.to_cbor(), DRAFTER)
            v = Verdict.from_cbor(r.body)
            verified += m
            committed += len(v.emitted)
            state = SessionState(sid, 1, v.round, v.committed, v.digest)
            if v.action == Action.FINISH:
                break
        return verified, committed

    start = time.perf_counter()
    results = await asyncio.gather(*(one_session(n) for n in range(sessions)))
    elapsed = time.perf_counter() - start
    await service.stop()
    await store.close()
    await log.close()
    verified = sum(v for v, _ in results)
    committed = sum(c for _, c in results)
    m = service.metrics
    return {"seconds": elapsed, "verified_per_s": verified / elapsed, "committed_per_s": committed / elapsed,
            "mean_batch": m.value("batch_size_sum") / m.value("batch_size_count")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:demo-target")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--m", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"model {args.model}, {args.sessions} sessions x {args.rounds} rounds, M = {args.m}, "
          f"torch threads {torch.get_num_threads()}")
    rows = {}
    for batching in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            rows[batching] = asyncio.run(run(args.model, args.sessions, args.rounds, args.m, batching, Path(tmp)))
        r = rows[batching]
        print(f"batching {'on ' if batching else 'off'}: {r['seconds']:.2f} s, "
              f"{r['verified_per_s']:.0f} verified tokens/s, {r['committed_per_s']:.0f} committed tokens/s, "
              f"mean batch {r['mean_batch']:.1f}")
    print(f"batching speedup: {rows[True]['verified_per_s'] / rows[False]['verified_per_s']:.2f}x")


if __name__ == "__main__":
    main()
