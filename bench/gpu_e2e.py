"""The verifier end to end on one GPU: engine, target model, q rows and kernels in one
process, every round split into forward, q-row staging (and how much of it the kernel did
not have to wait for), verify kernel and commit. Writes JSON; run by bench/gpu_check.sh.

    python3 bench/gpu_e2e.py --out DIR [--budget-s 150] [--rounds 8] [--smoke]

Targets: the built-in GPT (`tiny` backend, bf16 on CUDA) with random weights in the shape
of SmolLM2-135M (V 49,152, 30 layers, d 576, 9 heads, FFN 1,536) and of Llama-3.2-1B
(V 128,256, 16 layers, d 2,048, 32 heads, FFN 8,192), built from the config: no download.
Both use full multi-head attention where the real models share K/V heads (GQA), and the
built-in GPT attends per sequence (one launch per session and layer): its forward pass is
launch-bound at large B, which is what these rounds then cost. The `hf:` backend takes
over once it keeps K/V per session on a device (issue 13).

Grid: model x B {1, 8, 64} sessions x M {4, 8} x rule {1, 2} x kernel path {triton, torch};
"torch" is the vectorised torch path (`kernels/cpu.py`) run on the GPU's tensors, the
torch-native baseline, chosen like a user would (SDCP_KERNELS_PATH). Each point opens B
sessions (prompt of 64 random tokens) on a fresh verifier (embedded store and file commit
log on /dev/shm) and runs `--rounds` rounds in which all B sessions propose at once, so
every round is one batch; the first two rounds warm up and are not counted. Rule 2 q rows
come from a drafter-shaped source: one softmax of random logits per session, [M, V] fp32,
put in the embedded store's host tier (as a drafter on another machine would; `--q-tier
gpu` puts them in the GPU tier, as a drafter on the same host would), proposals drawn from
it. Per point: medians over the counted rounds of the engine's BatchTimes (device clocks),
the round as the drafters see it, and the share of q staging hidden behind the forward:
1 - sum(q wait) / sum(q read + q copy).
--smoke: tiny shapes on the CPU through the Triton interpreter (the whole script, quickly).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting points after this")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per point (2 of them warm up)")
    ap.add_argument("--q-tier", choices=("host", "gpu"), default="host")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter)")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from sdcp_fast.kernels.dispatch import ENV_VAR  # noqa: E402

from sdcp_fast.cache import open_log, open_store  # noqa: E402
from sdcp_fast.core.messages import (  # noqa: E402
    Action,
    Assignment,
    Contract,
    Proposal,
    Sampling,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from sdcp_fast.models.gpt import ModelConfig, Transformer  # noqa: E402
from sdcp_fast.models.tiny import TinyBackend  # noqa: E402
from sdcp_fast.refs import encode_session_id  # noqa: E402
from sdcp_fast.transport import Request  # noqa: E402
from sdcp_fast.transport.http import dispatch  # noqa: E402
from sdcp_fast.verifier import EngineConfig, VerifierConfig, VerifierService  # noqa: E402

ROUTER, DRAFTER, VERIFIER = "https://router/", "https://drafter/", "https://verifier/"
WARMUP_ROUNDS = 2
PROMPT = 64
SHAPES = {
    "smollm2-135m": ModelConfig(vocab_size=49_152, n_layer=30, n_head=9, d_model=576, d_ff=1_536,
                                max_seq_len=2_048, rope_base=100_000.0),
    "llama-3.2-1b": ModelConfig(vocab_size=128_256, n_layer=16, n_head=32, d_model=2_048, d_ff=8_192,
                                max_seq_len=2_048, rope_base=500_000.0),
    "smoke": ModelConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=256),
}
PATHS = {"triton": "triton", "torch": "cpu"}   # label -> SDCP_KERNELS_PATH


def build_target(shape: str, device: torch.device) -> TinyBackend:
    """Random weights in the shape's config, made on the device (no host copy of 1B params)."""
    cfg = SHAPES[shape]
    with torch.device(device):
        model = Transformer(cfg)
        model.init_weights(torch.Generator(device=device).manual_seed(0))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TinyBackend(model.eval(), bytes(32), device=device, dtype=dtype, max_kv_bytes=64 << 30)


async def run_point(target: TinyBackend, *, b: int, m: int, rule: int, path: str, workdir: Path,
                    device: torch.device) -> dict:
    """B sessions x ARGS.rounds rounds on a fresh verifier; the engine's split per round."""
    os.environ[ENV_VAR] = PATHS[path]   # read once, when the engine starts
    store = await open_store(f"embedded:{workdir / 'mlc'}")
    log = await open_log(f"file:{workdir / 'log'}")
    service = VerifierService(VerifierConfig(VERIFIER, frozenset({ROUTER})), target, store, log,
                              engine_config=EngineConfig(max_batch=max(b, 1), max_wait_ms=50.0,
                                                         prefetch_q=True))
    await service.start()
    engine = service.engine
    vocab = target.vocab_size
    contract = Contract(target=target.digest, tokenizer=target.tokenizer_digest, rule=rule, m_max=16,
                        max_new=100_000, stop=(), low_rounds=10_000, fallback=(Action.REDUCE,),
                        sampling=Sampling(seed=7) if rule == 2 else None)
    rng = random.Random(b * 100 + m * 10 + rule)

    async def call(method, url, body, caller):
        return await dispatch(service, Request(method, url, {}, "application/sdcp+cbor", body, caller))

    sids = [(1000 * b + n).to_bytes(16, "big") for n in range(b)]
    states, q_refs, drafts = {}, {}, {}
    for n, sid in enumerate(sids):
        prompt = tuple(rng.randrange(vocab) for _ in range(PROMPT))
        r = await call("POST", "/sessions", SessionOpen(sid, 1, contract, prompt, f"log/{b}-{n}").to_cbor(), ROUTER)
        assert r.status == 200, r.body
        state = SessionState.from_cbor(r.body)
        a = Assignment(sid, 1, contract, VERIFIER, DRAFTER, prompt, 0, 0, state.digest, m)
        r = await call("PUT", f"/sessions/{encode_session_id(sid)}/drafter", a.to_cbor(), ROUTER)
        assert r.status == 200, r.body
        states[sid] = SessionState.from_cbor(r.body)
        if rule == 2:   # a drafter's q rows: one [M, V] softmax per session, reused every round
            g = torch.Generator(device=device).manual_seed(n)
            q = torch.softmax(torch.randn(m, vocab, device=device, generator=g) * 2, dim=-1)
            q_refs[sid] = f"mlc:/q/{b}/{n}"
            if ARGS.q_tier == "gpu" and device.type == "cuda":
                await store.put_tensor(q_refs[sid], q, lease_ms=3_600_000)
            else:
                await store.put(q_refs[sid], q.cpu().numpy().tobytes(), lease_ms=3_600_000)
            # every round's draft tokens, drawn from q now (the drafter's work, not timed)
            drawn = torch.multinomial(q, ARGS.rounds, replacement=True, generator=g).T.tolist()
            drafts[sid] = [tuple(x) for x in drawn]
        else:
            drafts[sid] = [tuple(rng.randrange(vocab) for _ in range(m)) for _ in range(ARGS.rounds)]

    async def propose(sid: bytes, rnd: int) -> int:
        state = states[sid]
        ref, tokens = q_refs.get(sid), drafts[sid][rnd]
        p = Proposal(sid, 1, state.round + 1, DRAFTER, state.committed, state.digest, tokens,
                     Status(DRAFTER, 1, 0, 0, 1000), q_rows=ref)
        r = await call("POST", "/proposals", p.to_cbor(), DRAFTER)
        assert r.status == 200, r.body
        v = Verdict.from_cbor(r.body)
        states[sid] = SessionState(sid, 1, v.round, v.committed, v.digest)
        return len(v.emitted)

    round_ms, committed, warm_batches = [], 0, 0
    engine.batch_times.clear()
    for rnd in range(ARGS.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rnd == WARMUP_ROUNDS:
            warm_batches = len(engine.batch_times)
        t0 = time.perf_counter()
        emitted = await asyncio.gather(*(propose(sid, rnd) for sid in sids))
        if rnd >= WARMUP_ROUNDS:
            round_ms.append((time.perf_counter() - t0) * 1e3)
            committed += sum(emitted)
    times = list(engine.batch_times)
    await service.stop()
    for sid in sids:
        await service.target.release(sid)
    await store.close()
    await log.close()

    counted = times[warm_batches:]
    med = lambda name: round(statistics.median(getattr(t, name) for t in counted), 3)  # noqa: E731
    staging = sum(t.q_staging_ms for t in counted)
    point = dict(B=b, M=m, rule=rule, path=path, rounds=len(round_ms), batches=len(times),
                 mean_batch=round(sum(t.jobs for t in times) / max(1, len(times)), 2),
                 round_ms=round(statistics.median(round_ms), 3),
                 forward_ms=med("forward_ms"), q_read_ms=med("q_read_ms"), q_copy_ms=med("q_copy_ms"),
                 q_wait_ms=med("q_wait_ms"), kernel_ms=med("kernel_ms"), commit_ms=med("commit_ms"),
                 prefetched=sum(t.prefetched for t in counted), q_jobs=sum(t.q_jobs for t in counted),
                 committed_tokens_per_s=round(committed / (sum(round_ms) / 1e3), 1))
    if rule == 2:
        point["q_hidden_share"] = round(1 - sum(t.q_wait_ms for t in counted) / staging, 4) if staging else None
    return point


def grid(smoke: bool):
    if smoke:
        return [("smoke", b, m, rule, path) for b in (1, 3) for m in (2,) for rule in (1, 2)
                for path in ("triton", "torch")]
    # the goal's point (B 64, M 8, rule 2, the larger vocabulary) first: it must not be
    # the one the budget cuts
    first = [("llama-3.2-1b", 64, 8, 2, "triton"), ("llama-3.2-1b", 64, 8, 2, "torch")]
    rest = [(shape, b, m, rule, path) for shape in ("llama-3.2-1b", "smollm2-135m")
            for b in (64, 8, 1) for m in (8, 4) for rule in (2, 1) for path in ("triton", "torch")]
    return first + [p for p in rest if p not in first]


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not ARGS.smoke else "cpu")
    if device.type != "cuda" and not ARGS.smoke:
        print("no CUDA device: the e2e grid needs a GPU (use --smoke here)", file=sys.stderr)
        return 2
    if ARGS.smoke:
        ARGS.rounds = min(ARGS.rounds, WARMUP_ROUNDS + 2)
    shm = Path("/dev/shm")
    started = time.perf_counter()
    points, skipped, targets = [], [], {}
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, python=sys.version.split()[0], smoke=ARGS.smoke, q_tier=ARGS.q_tier,
        logits_dtype="bfloat16" if device.type == "cuda" else "float32", rounds=ARGS.rounds,
        warmup_rounds=WARMUP_ROUNDS, seconds=0.0, points=points, skipped_for_time=skipped)
    ARGS.out.mkdir(parents=True, exist_ok=True)
    for shape, b, m, rule, path in grid(ARGS.smoke):
        if time.perf_counter() - started > ARGS.budget_s:
            skipped.append(dict(model=shape, B=b, M=m, rule=rule, path=path))
            continue
        if shape not in targets:
            targets.clear()   # one model in memory at a time
            if device.type == "cuda":
                torch.cuda.empty_cache()
            targets[shape] = build_target(shape, device)
        with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
            point = asyncio.run(run_point(targets[shape], b=b, m=m, rule=rule, path=path,
                                          workdir=Path(tmp), device=device))
        points.append(dict(model=shape, V=SHAPES[shape].vocab_size, **point))
        print(json.dumps(points[-1]), flush=True)
        report["seconds"] = round(time.perf_counter() - started, 1)
        # after every point: a run stopped by the check's time limit keeps what it measured
        (ARGS.out / "gpu_e2e.json").write_text(json.dumps(report, indent=1))
    report["seconds"] = round(time.perf_counter() - started, 1)
    (ARGS.out / "gpu_e2e.json").write_text(json.dumps(report, indent=1))
    print(summary(points, skipped))
    return 0


def summary(points: list[dict], skipped: list[dict]) -> str:
    """One line: the largest rule-2 point with both paths, and how many points ran."""
    def find(path):
        cands = [p for p in points if p["rule"] == 2 and p["path"] == path]
        return max(cands, key=lambda p: (p["V"], p["B"], p["M"]), default=None)

    tri, nat = find("triton"), find("torch")
    head = f"gpu_e2e: {len(points)} points, {len(skipped)} skipped"
    if tri is None:
        return head
    line = (f"{head}; {tri['model']} B={tri['B']} M={tri['M']} rule 2: round {tri['round_ms']} ms "
            f"(forward {tri['forward_ms']}, kernel {tri['kernel_ms']}, commit {tri['commit_ms']}), "
            f"q hidden {100 * (tri.get('q_hidden_share') or 0):.0f}%")
    if nat is not None and (nat["model"], nat["B"], nat["M"]) == (tri["model"], tri["B"], tri["M"]):
        line += f", torch-native kernel {nat['kernel_ms']} ms"
    return line


if __name__ == "__main__":
    sys.exit(main())
