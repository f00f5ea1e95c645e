"""The verifier's device path: the built-in GPT as the target, the engine's kernel path and
q-row staging exactly as on a GPU, checked token for token against the float64 reference
path. In CI on device=cpu (Triton through its interpreter, streams and events as no-ops);
where CUDA is there and the interpreter is off (bench/gpu_check.sh), the same tests run with
the target, its logits, the q rows and the kernels on the GPU.

Sessions of rule 1 and rule 2 (with several sampling profiles) propose concurrently, so
batches mix rules, profiles and proposal lengths. Each session's drafter is deterministic
given what was committed: its proposal mixes the target's own greedy tokens (accepted) with
draws from a drafter-shaped q (a blend of the target's p and noise, published to the cache
as q rows), so every run sees the same proposals as long as the verdicts agree. A run is
the whole list of verdicts; the runs compared are Triton (interpreter) with q rows fetched
when each proposal is queued (the overlapped path) and with the plain fetch at batch time,
against the float64 reference path. Marked slow (about 30 s: the interpreter).
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch
from sdcp_fast.kernels.device import Device, Event

from sdcp_fast import kernels
from sdcp_fast.core.messages import Action, Sampling, SessionState, Verdict
from sdcp_fast.core.problems import Kind, Problem
from sdcp_fast.models.gpt import ModelConfig, Transformer
from sdcp_fast.models.tiny import TinyBackend
from sdcp_fast.verifier import EngineConfig
from tests.verifier.harness import Harness, contract_for

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
CFG = ModelConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=128)
DIGEST = bytes(range(32))
ROUNDS = 4
# (rule, sampling); rule 2 with a seed, so that reruns draw alike. One filtered profile
# only: its pivot searches cost the interpreter about 0.4 s a row.
SESSIONS = [
    (1, None),
    (1, Sampling(temperature_milli=700)),
    (2, Sampling(seed=3)),
    (2, Sampling(temperature_milli=1300, seed=4)),
    (2, Sampling(temperature_milli=800, top_k=40, top_p_milli=900, seed=5)),
]


def model() -> Transformer:
    m = Transformer(CFG)
    m.init_weights(torch.Generator().manual_seed(11))
    with torch.no_grad():  # peaked logits: greedy continuations are stable, draws are not flat
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(6)
    return m.eval()


class Drafter:
    """Proposals that depend only on (session, round, committed sequence)."""

    def __init__(self, target: TinyBackend, rule: int, sampling: Sampling | None):
        self.target, self.rule, self.sampling = target, rule, sampling

    def propose(self, n: int, rnd: int, sequence: list[int]) -> tuple[list[int], torch.Tensor | None]:
        g = torch.Generator().manual_seed(1000 * n + rnd)
        rng = random.Random(1000 * n + rnd)
        m = rng.randint(1, 3)
        sid = b"draft-%d" % n
        self.target.open(sid, sequence)
        try:
            tokens, rows = [], []
            for _ in range(m):
                logits = self.target.score([(sid, tokens)])[-1].double()
                if self.rule == 1:
                    token = int(logits.argmax()) if rng.random() < 0.7 else rng.randrange(CFG.vocab_size)
                    tokens.append(token)
                    continue
                p = kernels.target_probs(logits[None], **(self.sampling.transform() if self.sampling else {}),
                                         path="reference")[0]
                noise = torch.softmax(torch.randn(CFG.vocab_size, generator=g, dtype=torch.float64) * 2, -1)
                q = (0.6 * p + 0.4 * noise).float()
                q = q / q.sum()
                tokens.append(int(torch.multinomial(q.double(), 1, generator=g)))
                rows.append(q)
        finally:
            self.target.release(sid)
        return tokens, (torch.stack(rows) if rows else None)


async def run(h: Harness, drafter_backend: TinyBackend) -> dict[int, list[tuple]]:
    """Every session's verdicts as (round, accepted, emitted, action)."""

    async def one(n: int, rule: int, sampling: Sampling | None):
        contract = contract_for(h.backend, rule=rule, sampling=sampling, m_max=8, max_new=60,
                                low_rounds=10_000, fallback=(Action.REDUCE,))
        prompt = tuple(random.Random(n).randrange(CFG.vocab_size) for _ in range(5))
        sid = (n + 1).to_bytes(16, "big")
        _, r = await h.open(contract, prompt=prompt, sid=sid)
        assert r.status == 200, r.body
        r = await h.assign(sid, contract, SessionState.from_cbor(r.body))
        state = SessionState.from_cbor(r.body)
        drafter = Drafter(drafter_backend, rule, sampling)
        committed, out = list(prompt), []
        for _ in range(ROUNDS):
            tokens, q = drafter.propose(n, state.round, committed)
            ref = None
            if q is not None:
                ref = f"mlc:/q/{n}/{state.round}"
                await h.store.put(ref, q.numpy().tobytes(), lease_ms=60_000)
            r = await h.propose(sid, state, tokens, q_rows=ref)
            assert r.status == 200, r.body
            v = Verdict.from_cbor(r.body)
            out.append((v.round, v.accepted, v.emitted, v.action))
            committed += v.emitted
            state = SessionState(sid, 1, v.round, v.committed, v.digest)
            if v.action == Action.FINISH:
                break
        return n, out

    return dict(await asyncio.gather(*(one(n, rule, s) for n, (rule, s) in enumerate(SESSIONS))))


async def verdicts(workdir, monkeypatch, path: str, **engine) -> tuple[dict, list]:
    monkeypatch.setenv(kernels.dispatch.ENV_VAR, path)   # read once, when the engine starts
    config = EngineConfig(max_wait_ms=20.0, **engine)
    h = await Harness.start(workdir, backend=TinyBackend(model(), DIGEST, device=DEVICE), engine_config=config)
    try:
        assert h.service.engine.kernels_path == path and h.service.engine.device.type == DEVICE
        return await run(h, TinyBackend(model(), DIGEST)), list(h.service.engine.batch_times)
    finally:
        await h.close()


@pytest.mark.slow
def test_engine_device_path_is_token_exact_against_the_reference(tmp_path, monkeypatch):
    async def main():
        runs = {}
        for name, path, engine in (
            ("reference", "reference", dict(prefetch_q=False)),
            ("triton-overlapped", "triton", dict(prefetch_q=True)),
            ("triton-plain", "triton", dict(prefetch_q=False)),
        ):
            (tmp_path / name).mkdir()
            runs[name] = await verdicts(tmp_path / name, monkeypatch, path, **engine)
        return runs

    runs = asyncio.run(asyncio.wait_for(main(), 600))
    reference, _ = runs["reference"]
    assert sum(len(v) for v in reference.values()) >= len(SESSIONS) * 3
    accepted = [a for v in reference.values() for _, a, _, _ in v]
    assert 0 < sum(accepted) and min(accepted) == 0   # acceptances and rejections both seen
    for name, (got, times) in runs.items():
        assert got == reference, name
        assert max(t.jobs for t in times) > 1, name   # sessions really were batched
    prefetched = {name: sum(t.prefetched for t in times) for name, (_, times) in runs.items()}
    q_jobs = sum(t.q_jobs for t in runs["triton-overlapped"][1])
    assert prefetched["triton-overlapped"] == q_jobs > 0
    assert prefetched["triton-plain"] == prefetched["reference"] == 0


def test_batch_times_split_a_round(tmp_path, monkeypatch):
    """Every batch reports where its time went; the q share hidden is a share."""

    async def main():
        return await verdicts(tmp_path, monkeypatch, "cpu", prefetch_q=True)

    _, times = asyncio.run(asyncio.wait_for(main(), 300))
    assert times and all(t.forward_ms > 0 and t.kernel_ms > 0 and t.commit_ms > 0 for t in times)
    with_q = [t for t in times if t.q_jobs]
    assert with_q and all(t.q_read_ms > 0 and t.q_wait_ms >= 0 for t in with_q)
    assert all(0.0 <= t.q_hidden_share <= 1.0 for t in with_q)
    assert all(t.q_hidden_share is None for t in times if not t.q_jobs)


def test_missing_q_rows_are_refused_alike_overlapped_or_plain(tmp_path, monkeypatch):
    """A proposal whose q rows are gone gets sdcp-q-unavailable whether its fetch started
    when it was queued or with its batch; the session's next proposal is verified."""

    async def one(workdir, prefetch):
        monkeypatch.setenv(kernels.dispatch.ENV_VAR, "cpu")
        h = await Harness.start(workdir, backend=TinyBackend(model(), DIGEST, device=DEVICE),
                                engine_config=EngineConfig(prefetch_q=prefetch))
        try:
            contract = contract_for(h.backend, rule=2, m_max=8, max_new=60, sampling=Sampling(seed=9))
            sid, r = await h.open(contract, prompt=(1, 2, 3), sid=bytes(16))
            state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
            gone = await h.propose(sid, state, [4, 5], q_rows="mlc:/q/never-written")
            q = torch.full((2, CFG.vocab_size), 1.0 / CFG.vocab_size)
            await h.store.put("mlc:/q/there", q.numpy().tobytes(), lease_ms=60_000)
            there = await h.propose(sid, state, [4, 5], q_rows="mlc:/q/there")
            return gone, there, h.service.engine._stager.pooled_bytes
        finally:
            await h.close()

    async def main():
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        return await one(tmp_path / "a", True), await one(tmp_path / "b", False)

    (gone_a, there_a, pooled_a), (gone_b, there_b, pooled_b) = asyncio.run(asyncio.wait_for(main(), 120))
    for gone in (gone_a, gone_b):
        assert gone.status == 409
        assert Problem.from_json(gone.body).kind == Kind.Q_UNAVAILABLE
    assert there_a.status == there_b.status == 200
    assert Verdict.from_cbor(there_a.body) == Verdict.from_cbor(there_b.body)
    assert pooled_a == 2 * CFG.vocab_size * 4   # the good fetch's slot was kept for reuse
    assert pooled_b == 0                         # the plain path holds no slots


@pytest.mark.gpu
def test_device_interface_on_cuda_orders_side_stream_copies():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = Device("cuda")
    host = dev.host_empty(1 << 20)
    host.copy_(torch.arange(1 << 20, dtype=torch.float32))
    out = torch.empty(1 << 20, device="cuda")
    with dev.side():
        began = dev.event()
        out.copy_(host, non_blocking=True)
        ready = dev.event()
    dev.wait(ready)
    total = out.sum()   # on the compute stream, after the copy
    assert host.is_pinned() and float(total) == float(torch.arange(1 << 20, dtype=torch.float64).sum())
    assert ready.done() and ready.since(began) >= 0


def test_device_interface_is_a_no_op_on_the_cpu():
    dev = Device("cpu")
    with dev.side():
        a = dev.event()
        t = dev.empty(2, 3)
        t.copy_(torch.ones(2, 3), non_blocking=True)
        b = dev.event()
    with dev.use():
        dev.wait(b)
    b.synchronize()
    assert b.done() and b.since(a) >= 0 and torch.equal(t, torch.ones(2, 3))
    assert not dev.host_empty(4).is_pinned() and dev.torch == torch.device("cpu")
    recorded = Event(torch.device("cpu")).record()   # what dev.event() is, made the long way
    assert recorded.done() and recorded.since(b) >= 0 and dev.event().since(recorded) >= 0


def test_kernel_path_follows_the_device_and_is_logged_once(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(kernels.dispatch.ENV_VAR, raising=False)

    async def main():
        h = await Harness.start(tmp_path, backend=TinyBackend(model(), DIGEST, device=DEVICE))
        try:
            contract = contract_for(h.backend, m_max=8, max_new=60)
            sid, r = await h.open(contract, prompt=(1, 2, 3))
            state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
            for _ in range(2):
                r = await h.propose(sid, state, [4, 5])
                v = Verdict.from_cbor(r.body)
                state = SessionState(sid, 1, v.round, v.committed, v.digest)
            return h.service.engine.kernels_path
        finally:
            await h.close()

    with caplog.at_level("INFO", logger="sdcp_fast.verifier.engine"):
        path = asyncio.run(asyncio.wait_for(main(), 120))
    assert path == ("triton" if DEVICE == "cuda" else kernels.choose_path(torch.device("cpu")))
    assert path in (("triton",) if DEVICE == "cuda" else ("native", "cpu"))
    lines = [r.getMessage() for r in caplog.records if "verify kernels" in r.getMessage()]
    assert lines == [f"verify kernels: {path} path on {DEVICE} (chosen by the device)"]


def test_a_failed_batch_gives_its_q_slots_back(tmp_path, monkeypatch):
    """A forward pass that fails (a bug, not a refusal) answers 503 and returns the batch's
    staging slots to the pool: the next proposal is fetched ahead again."""
    monkeypatch.setenv(kernels.dispatch.ENV_VAR, "cpu")

    async def main():
        slot = 2 * CFG.vocab_size * 4   # a pool with room for one proposal's rows
        h = await Harness.start(tmp_path, backend=TinyBackend(model(), DIGEST, device=DEVICE),
                                engine_config=EngineConfig(prefetch_q=True, q_staging_bytes=slot))
        try:
            engine = h.service.engine
            contract = contract_for(h.backend, rule=2, m_max=8, max_new=60, sampling=Sampling(seed=9))
            sid, r = await h.open(contract, prompt=(1, 2, 3), sid=bytes(16))
            state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
            q = torch.full((2, CFG.vocab_size), 1.0 / CFG.vocab_size)
            await h.store.put("mlc:/q/a", q.numpy().tobytes(), lease_ms=60_000)
            score = engine.target.score

            async def broken(items):
                engine.target.score = score
                raise RuntimeError("a bug in the forward pass")

            engine.target.score = broken
            failed = await h.propose(sid, state, [4, 5], q_rows="mlc:/q/a")
            pooled = engine._stager.pooled_bytes
            ok = await h.propose(sid, state, [4, 5], q_rows="mlc:/q/a")
            return failed, pooled, ok, list(engine.batch_times)
        finally:
            await h.close()

    failed, pooled, ok, times = asyncio.run(asyncio.wait_for(main(), 120))
    assert failed.status == 503 and ok.status == 200
    assert pooled == 2 * CFG.vocab_size * 4
    assert times[-1].prefetched == times[-1].q_jobs == 1   # the one slot was back in the pool
