"""`sdcp-fast demo`: the whole system on one machine, the README's main job.

1. Certificates for every instance in a work directory (a CA and one certificate per
   instance URI), an embedded object store and a file commit log there.
2. A router, a verifier (the demo target model) and two drafters (the demo draft model) as
   separate `sdcp-fast serve` processes, speaking HTTP/2 (or HTTP/3) with mutual TLS on
   loopback.
3. A few Python prompts sent together to the router's front door; their text streams in as
   it is committed, one line per prompt.
4. A table per prompt: tokens/s, accepted tokens per round, tokens per target pass,
   acceptance rate, escalations; then the same prompts decoded by the target alone
   (greedy, the prompts batched together in one process) for comparison, the speedup,
   and whether the outputs are identical (under rule 1 they must be).
5. With --plot PATH, a PNG of accepted tokens and m_cap per round (needs matplotlib).

Every process is stopped on exit, on an error and on Ctrl-C. SDCP_DEMO_TARGET and
SDCP_DEMO_DRAFT (model specs) replace the shipped pair, e.g. for a development build.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    def __repr__(self):\n        return ",
    "for key, value in sorted(mapping.items()):\n    if ",
    "try:\n    import json\nexcept ImportError:\n",
    "def test_split(self):\n        self.assertEqual(",
    "        if not isinstance(name, str):\n            raise TypeError(",
]
ESCALATIONS = ("reduce", "switch", "self_decode", "fail")


@dataclass
class Generation:
    prompt: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    gid: str = ""
    finish: str | None = None
    seconds: float = 0.0
    error: str | None = None


def main(args: argparse.Namespace) -> int:
    def terminate(signum, frame):   # SIGTERM: clean up as for Ctrl-C, once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    code, _ = run(protocol=args.protocol, prompts=args.prompts, max_new=args.max_new,
                  workdir=args.workdir, plot=args.plot)
    return code


def run(*, protocol: str = "h2", prompts: int = 4, max_new: int = 96, workdir: str | None = None,
        plot: str | None = None) -> tuple[int, dict]:
    """The demo; returns (exit code, summary of the table's last rows) for bench/bench_demo.py."""
    target_spec = os.environ.get("SDCP_DEMO_TARGET", "tiny:demo-target")
    draft_spec = os.environ.get("SDCP_DEMO_DRAFT", "tiny:demo-draft")
    n_prompts = max(1, min(prompts, len(PROMPTS)))
    try:
        from .models import load_backend
        target, draft = load_backend(target_spec), load_backend(draft_spec)
    except (FileNotFoundError, KeyError, ValueError, OSError) as exc:
        print(f"demo: cannot load the demo models ({target_spec}, {draft_spec}): {exc}\n"
              "      train them with: .venv/bin/python scripts/train_demo.py --out sdcp_fast/models/demo",
              file=sys.stderr)
        return 1, {}
    keep = workdir is not None
    root = Path(workdir) if keep else Path(tempfile.mkdtemp(prefix="sdcp-demo-", dir=_fast_tmp()))
    root.mkdir(parents=True, exist_ok=True)
    from .procs import Cluster

    cluster = Cluster(root, protocol=protocol)
    options = argparse.Namespace(protocol=protocol, max_new=max_new, plot=plot)
    try:
        return _run(options, cluster, target, draft, target_spec, draft_spec, n_prompts)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the processes", file=sys.stderr)
        return 130, {}
    finally:
        cluster.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _run(args, cluster, target, draft, target_spec, draft_spec, n_prompts) -> tuple[int, dict]:
    protocol = {"h2": "HTTP/2", "h3": "HTTP/3"}[args.protocol]
    print(f"sdcp-fast demo: target {target_spec} ({target.digest.hex()[:12]}), "
          f"draft {draft_spec} ({draft.digest.hex()[:12]})")
    print(f"work directory {cluster.workdir}")
    # TTLs with room for a busy 2-core machine: an instance is declared dead only when silent
    cluster.verifier("verifier", model=target_spec, max_wait_ms=1.0, ttl_ms=3000, status_interval_s=0.5)
    for name in ("drafter-1", "drafter-2"):
        cluster.drafter(name, model=draft_spec, ttl_ms=2000, status_interval_s=0.4)
    cluster.router(model=target_spec, drafter_models={"drafter-1": draft.digest.hex(),
                                                      "drafter-2": draft.digest.hex()},
                   contract={"rule": 1, "m_max": 8, "max_new": args.max_new, "low_rounds": 4,
                             "fallback": ["reduce", "switch", "self_decode"], "self_load": 60,
                             "self_max": 16})
    started = time.perf_counter()
    print(f"starting router, verifier and 2 drafters as processes ({protocol} + mutual TLS 1.3 on "
          f"loopback) ...", flush=True)
    cluster.start(timeout=90)
    front = cluster.instances["router"].frontdoor_url
    _wait_live(front, 3, timeout=30)   # verifier and drafters report status
    print(f"all serving after {time.perf_counter() - started:.1f} s; front door {front}\n", flush=True)

    prompts = PROMPTS[:n_prompts]
    generations = [Generation(p) for p in prompts]
    wall = _generate_all(front, generations, args.max_new)
    failed = [g for g in generations if g.error or g.finish != "finish"]
    records = _rounds(cluster)
    cluster.stop()   # the comparison runs alone on the CPU

    print("\ndecoding the same prompts with the target alone (greedy; batched, then one by one) ...",
          flush=True)
    baseline = _target_alone(target, [target.encode(p) for p in prompts],
                             [len(g.tokens) or args.max_new for g in generations])
    _print_texts(generations, target)
    summary = _print_table(generations, records, wall, baseline)
    if args.plot:
        _plot(args.plot, records, generations)
    if failed:
        print(f"\n{len(failed)} generation(s) did not finish: "
              + "; ".join(f"{g.gid or '?'}: {g.error or g.finish}" for g in failed), file=sys.stderr)
        return 1, summary
    return (0 if summary["identical"] == len(generations) else 1), summary


# ---------------------------------------------------------------------- generation


def _generate_all(front: str, generations: list[Generation], max_new: int) -> float:
    """Stream every prompt at once; show one live line per prompt. Returns wall seconds."""
    live = sys.stdout.isatty()
    lock = threading.Lock()
    started = time.perf_counter()
    done = threading.Event()

    def show() -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 16
        with lock:
            for n, g in enumerate(generations):
                tail = (g.text.replace("\n", "\u21b5")[-width:]) if g.text else ""
                print(f"\x1b[2K[{n + 1}] {len(g.tokens):3d}/{max_new} {tail}")
            print(f"\x1b[{len(generations)}A", end="", flush=True)

    def progress() -> None:
        while not done.wait(0.1 if live else 1.0):
            if live:
                show()
            else:
                with lock:
                    counts = " ".join(f"[{n + 1}] {len(g.tokens)}" for n, g in enumerate(generations))
                print(f"  {time.perf_counter() - started:5.1f} s  tokens {counts}", flush=True)

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    pool = ThreadPoolExecutor(len(generations))
    try:
        list(pool.map(lambda g: _stream_one(front, g, max_new, lock), generations))
    finally:
        # on Ctrl-C do not wait for the streams: stopping the processes ends them
        pool.shutdown(wait=False, cancel_futures=True)
        done.set()
    wall = time.perf_counter() - started
    ticker.join()
    if live:
        show()
        print("\n" * len(generations), end="")
    return wall


def _stream_one(front: str, g: Generation, max_new: int, lock: threading.Lock) -> None:
    import httpx

    try:
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as http, \
                http.stream("POST", f"{front}/v1/generate", json={"prompt": g.prompt, "max_new": max_new}) as r:
            if r.status_code != 200:
                g.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return
            name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    with lock:
                        if name == "start":
                            g.gid = data["id"]
                        elif name == "tokens":
                            g.tokens.extend(data["tokens"])
                            g.text += data["text"]
                        elif name == "end":
                            g.finish, g.text = data["finish"], data["text"]
                            g.seconds = data.get("seconds") or 0.0
    except Exception as exc:   # the table reports it; the demo still cleans up
        g.error = f"{type(exc).__name__}: {exc}"


def _wait_live(front: str, count: int, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            instances = httpx.get(f"{front}/v1/instances", timeout=5).json()["instances"]
            if sum(1 for i in instances if i["live"]) >= count:
                return
        if time.monotonic() > deadline:
            raise TimeoutError("instances did not report status in time")
        time.sleep(0.1)


def _rounds(cluster) -> list[dict]:
    out = []
    for name in ("drafter-1", "drafter-2"):
        path = cluster.workdir / f"{name}.rounds.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if not record.get("dropped"):
                    record["drafter"] = name
                    out.append(record)
    return sorted(out, key=lambda r: r["t"])


# ---------------------------------------------------------------------- the comparison


@dataclass
class Baseline:
    """The target alone, greedy: outputs and times, prompts batched and one at a time."""

    outputs: list[list[int]]
    batched_s: float               # all prompts in each forward pass
    each_s: list[float]            # each prompt decoded alone

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.outputs)


def _target_alone(backend, prompts: list[list[int]], lengths: list[int]) -> Baseline:
    """Greedy decoding by the target alone, one forward pass per token: once with every
    prompt in each pass (the concurrency the verifier had), once prompt by prompt."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as each serving process runs (procs.Cluster): a like-for-like CPU
    try:
        outputs, batched = _decode_alone(backend, prompts, lengths)
        each = []
        for n in range(len(prompts)):
            single, seconds = _decode_alone(backend, prompts[n:n + 1], lengths[n:n + 1])
            assert single[0] == outputs[n], "the target's greedy decoding is not deterministic"
            each.append(seconds)
        return Baseline(outputs, batched, each)
    finally:
        torch.set_num_threads(threads)


def _decode_alone(backend, prompts, lengths) -> tuple[list[list[int]], float]:
    import torch

    ids = [f"alone-{n}".encode() for n in range(len(prompts))]
    for sid, prompt in zip(ids, prompts, strict=True):
        backend.open(sid, prompt)
    outputs: list[list[int]] = [[] for _ in prompts]
    started = time.perf_counter()
    active = [n for n in range(len(prompts)) if lengths[n] > 0]
    while active:
        logits = backend.score([(ids[n], []) for n in active])      # [len(active), V]
        for row, n in enumerate(active):
            token = int(torch.argmax(logits[row]))
            backend.commit(ids[n], [token])
            outputs[n].append(token)
        active = [n for n in active if len(outputs[n]) < lengths[n]]
    wall = time.perf_counter() - started
    for sid in ids:
        backend.release(sid)
    return outputs, wall


# ---------------------------------------------------------------------- reporting


def _print_texts(generations: list[Generation], backend) -> None:
    for n, g in enumerate(generations):
        print(f"\n--- [{n + 1}] {g.finish or g.error} ---")
        print(g.prompt + "\x1b[1m" + backend.decode(g.tokens) + "\x1b[0m" if sys.stdout.isatty()
              else g.prompt + backend.decode(g.tokens))


def summarize(records: list[dict]) -> dict:
    """Per-round statistics of one or more sessions (drafters' round records)."""
    rounds = len(records)
    proposed = sum(r["m"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    emitted = sum(r["emitted"] for r in records)
    escalations = sum(1 for r in records if r["action"] in ESCALATIONS)
    return {"rounds": rounds, "accepted_per_round": accepted / rounds if rounds else 0.0,
            "tokens_per_round": emitted / rounds if rounds else 0.0,
            "acceptance": accepted / proposed if proposed else 0.0, "escalations": escalations}


def _print_table(generations, records, wall, baseline: Baseline) -> dict:
    by_session: dict[str, list[dict]] = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    header = (f"{'prompt':>6} {'tokens':>6} {'rounds':>6} {'acc/rnd':>7} {'tok/pass':>8} {'accept':>6} "
              f"{'escal':>5} {'SDCP tok/s':>10} {'alone tok/s':>11} {'speedup':>7} {'same':>5}")
    print("\n" + header)
    print("-" * len(header))
    identical = 0
    for n, g in enumerate(generations):
        stats = summarize(by_session.get(g.gid, []))
        same = g.tokens == baseline.outputs[n]
        identical += same
        rate = len(g.tokens) / g.seconds if g.seconds else 0.0
        alone = len(baseline.outputs[n]) / baseline.each_s[n] if baseline.each_s[n] else 0.0
        print(f"{n + 1:>6} {len(g.tokens):>6} {stats['rounds']:>6} {stats['accepted_per_round']:>7.2f} "
              f"{stats['tokens_per_round']:>8.2f} {stats['acceptance']:>6.0%} {stats['escalations']:>5} "
              f"{rate:>10.1f} {alone:>11.1f} {rate / alone if alone else 0:>6.2f}x {'yes' if same else 'NO':>5}")
    total = summarize(records)
    tokens = sum(len(g.tokens) for g in generations)
    sdcp_rate = tokens / wall if wall else 0.0
    batched_rate = baseline.tokens / baseline.batched_s if baseline.batched_s else 0.0
    each_rate = baseline.tokens / sum(baseline.each_s) if sum(baseline.each_s) else 0.0
    print("-" * len(header))
    print(f"{'all':>6} {tokens:>6} {total['rounds']:>6} {total['accepted_per_round']:>7.2f} "
          f"{total['tokens_per_round']:>8.2f} {total['acceptance']:>6.0%} {total['escalations']:>5} "
          f"{sdcp_rate:>10.1f} {batched_rate:>11.1f} {sdcp_rate / batched_rate if batched_rate else 0:>6.2f}x "
          f"{identical}/{len(generations)}")
    self_decoded = tokens - sum(r["emitted"] for r in records)
    passes = 1 / total["tokens_per_round"] if total["tokens_per_round"] else 1.0
    print(f"\nSDCP, {len(generations)} prompts at once (router, verifier, 2 drafters):   "
          f"{tokens} tokens in {wall:.2f} s = {sdcp_rate:.1f} tokens/s")
    print(f"target alone, prompts batched in each pass:             "
          f"{baseline.tokens} tokens in {baseline.batched_s:.2f} s = {batched_rate:.1f} tokens/s")
    print(f"target alone, one prompt at a time:                     "
          f"{baseline.tokens} tokens in {sum(baseline.each_s):.2f} s = {each_rate:.1f} tokens/s")
    print(f"speedup (wall clock, all prompts): {sdcp_rate / batched_rate if batched_rate else 0:.2f}x "
          f"over batched, {sdcp_rate / each_rate if each_rate else 0:.2f}x over one at a time")
    print(f"target passes per token: {passes:.2f} (target alone: 1.00); escalations: "
          f"{total['escalations']}; tokens the verifier decoded itself: {self_decoded}")
    print(f"outputs identical to the target's greedy decoding: {identical}/{len(generations)} "
          "(rule 1: they must all be)")
    return {"tokens": tokens, "wall_s": wall, "sdcp_tokens_per_s": sdcp_rate,
            "alone_tokens_per_s": batched_rate, "alone_each_tokens_per_s": each_rate,
            "speedup": sdcp_rate / batched_rate if batched_rate else 0.0,
            "speedup_each": sdcp_rate / each_rate if each_rate else 0.0,
            "tokens_per_round": total["tokens_per_round"], "accepted_per_round": total["accepted_per_round"],
            "acceptance": total["acceptance"], "escalations": total["escalations"],
            "self_decoded": self_decoded, "identical": identical, "rounds": total["rounds"]}


def _plot(path: str, records: list[dict], generations: list[Generation]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n--plot: matplotlib is not installed (pip install matplotlib); no plot written")
        return
    fig, axes = plt.subplots(len(generations), 1, figsize=(9, 2.2 * len(generations)), squeeze=False)
    for n, g in enumerate(generations):
        mine = [r for r in records if r["session"] == g.gid]
        ax = axes[n][0]
        ax.bar([r["round"] for r in mine], [r["accepted"] for r in mine], color="tab:blue", label="accepted")
        ax.step([r["round"] for r in mine], [r["m_cap"] for r in mine], where="mid", color="tab:red",
                label="m_cap")
        ax.set_ylabel(f"[{n + 1}]")
        if n == 0:
            ax.legend(loc="upper right")
    axes[-1][0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nplot written to {path}")


def _fast_tmp() -> str | None:
    """tmpfs for the work directory when there is one: the commit log syncs every record."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
