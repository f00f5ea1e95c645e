"""Where the time goes when the real pair serves several prompts at once between processes.

    .venv/bin/python bench/timeline_real.py [--prompts 4] [--new-tokens 128] [--m 5]
                                            [--max-wait-ms 1.0] [--company-share 0,0.5]
                                            [--repeats 1] [--keep DIR]

bench_real.py's cluster (router, verifier with the SmolLM2 target, one drafter with the
demo's draft; HTTP/2 mTLS on loopback), the prompts sent at once, with two logs turned on:
the verifier's batch log (a JSON line per verify batch: when it formed, whose jobs, how
long each job waited, the forward pass, the commit) and the drafter's rounds log (per
round: when building the proposal began, when it was sent, when its verdict came back, how
many of its tokens were drafted ahead during the previous round). Then the same prompts
through the speculative loop in this process (bench_real.in_process), the reference that
has no processes.

It prints the timeline's summary: sessions per verify pass and what a pass costs at each
width, how much of the wall time the verifier's model was busy, and a round split into
building (drafting not hidden behind the verifier), the trip to the verifier and back
(queue wait, pass, commit, transport), and the step from the verdict to the next proposal.
`--company-share 0,0.5` starts a cluster for each value and alternates the runs between
them and the one-process loop (`--repeats` rounds), so that a shared machine's drifting
load weighs on each alike. Last line: `4 prompts, medians: one process Y.Y tok/s; company_share
S: X.X tok/s (Z.ZZx), A.AA sessions a pass, verifier busy B%; ...` (Z: over the one-process
loop).
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
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_real import PROMPTS, best_draft, fast_tmp, in_process, sdcp_at_once, start_sdcp  # noqa: E402

from sdcp_fast.demo.hf_baseline import chat_prompts, end_of_turn  # noqa: E402


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def summarise(batches: list[dict], rounds: list[dict], wall: float) -> dict:
    """The timeline's figures (milliseconds unless named otherwise)."""
    widths = Counter(len(b["sessions"]) for b in batches)
    cost = defaultdict(list)
    for b in batches:
        cost[len(b["sessions"])].append(b["forward_ms"])
    busy = sum(b["end"] - b["t"] for b in batches)
    rounds = [r for r in rounds if r.get("sent_at")]
    by_session = defaultdict(list)
    for r in sorted(rounds, key=lambda r: r["sent_at"]):
        by_session[r["session"]].append(r)
    verdict_to_next = [b["sent_at"] - a["answered_at"] for rs in by_session.values() for a, b in pairwise(rs)]
    waited = [w for b in batches for w in b["waited_ms"]]
    trip = [r["answered_at"] - r["sent_at"] for r in rounds]
    in_batch = [b["end"] - b["t"] for b in batches for _ in b["sessions"]]
    return {
        "batches": len(batches), "rounds": len(rounds),
        "per_pass": sum(len(b["sessions"]) for b in batches) / max(1, len(batches)),
        "widths": dict(sorted(widths.items())),
        "forward_by_width": {w: statistics.median(v) for w, v in sorted(cost.items())},
        "commit_ms": statistics.median(b["commit_ms"] for b in batches) if batches else 0.0,
        "busy_share": busy / wall if wall else 0.0,
        "queue_wait_ms": statistics.median(waited) if waited else 0.0,
        "trip_ms": 1e3 * statistics.median(trip) if trip else 0.0,
        "batch_ms": 1e3 * statistics.median(in_batch) if in_batch else 0.0,
        "verdict_to_next_ms": 1e3 * statistics.median(verdict_to_next) if verdict_to_next else 0.0,
        "verdict_to_next_mean_ms": 1e3 * statistics.mean(verdict_to_next) if verdict_to_next else 0.0,
        "ahead_share": sum(r.get("ahead", 0) for r in rounds) / max(1, sum(r["m"] for r in rounds)),
        "tokens_per_round": sum(r["emitted"] for r in rounds) / max(1, len(rounds)),
        "m": statistics.mean(r["m"] for r in rounds) if rounds else 0.0,
    }


def report(s: dict) -> str:
    widths = ", ".join(f"{w}: {n}" for w, n in s["widths"].items())
    costs = ", ".join(f"{w}: {ms:.0f} ms" for w, ms in s["forward_by_width"].items())
    return "\n".join([
        f"verify passes {s['batches']} for {s['rounds']} rounds: {s['per_pass']:.2f} sessions a pass "
        f"(passes by width {widths})",
        f"forward pass, median by width: {costs}; commit {s['commit_ms']:.1f} ms a batch",
        f"verifier busy {100 * s['busy_share']:.0f}% of the wall time (batch formed -> verdicts out)",
        f"a round, medians: queue wait {s['queue_wait_ms']:.1f} ms, batch {s['batch_ms']:.0f} ms, "
        f"proposal sent -> verdict back {s['trip_ms']:.0f} ms, verdict -> next proposal sent "
        f"{s['verdict_to_next_ms']:.1f} ms (mean {s['verdict_to_next_mean_ms']:.1f})",
        f"M {s['m']:.2f}, tokens a round {s['tokens_per_round']:.2f}, drafted ahead "
        f"{100 * s['ahead_share']:.0f}% of the proposed tokens",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--m", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-wait-ms", type=float, default=None, help="the verifier's (default: bench_real's)")
    ap.add_argument("--company-share", default="",
                    help="the verifier's wait for late sessions; several, comma-separated (e.g. 0,0.5), "
                    "start one cluster each and alternate between them (default: the config's)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of the prompts at once, per variant")
    ap.add_argument("--keep", help="keep the work directory (logs) here")
    args = ap.parse_args()

    from sdcp_fast.models import load_backend
    from sdcp_fast.models.hf import HFBackend
    from sdcp_fast.models.real_tokenizer import SMOLLM2, resolve_gguf

    torch.set_num_threads(args.threads)
    gguf = resolve_gguf(SMOLLM2)
    target = HFBackend(gguf, threads=args.threads)
    eos = end_of_turn(target.tokenizer)
    prompts = chat_prompts(target.tokenizer, PROMPTS[:args.prompts])
    draft_spec = f"{best_draft()}:smollm2"
    draft = load_backend(draft_spec)
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sdcp-timeline-", dir=fast_tmp()))
    workdir.mkdir(parents=True, exist_ok=True)
    shares = [float(x) for x in args.company_share.split(",") if x.strip()] or [None]
    variants = []    # (name, options, workdir)
    for n, share in enumerate(shares):
        where = workdir / f"variant-{n}"
        options = {"batch_log": str(where / "cluster" / "verifier.batches.jsonl")}
        if args.max_wait_ms is not None:
            options["max_wait_ms"] = args.max_wait_ms
        if share is not None:
            options["company_share"] = share
        variants.append((f"company_share {share if share is not None else 'default'}", options, where))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; draft {draft_spec}", flush=True)
    rates = {name: [] for name, _, _ in variants}
    summaries = {name: [] for name, _, _ in variants}
    loops = []
    clusters = []
    try:
        for name, options, where in variants:
            cluster, front = start_sdcp(where, f"hf:{gguf}", draft_spec, draft.digest.hex(), args.m,
                                        args.new_tokens, eos, args.threads, **options)
            clusters.append((name, cluster, front, Path(options["batch_log"])))
            sdcp_at_once(front, [p[:] for p in prompts], 4, eos)   # warm-up, untimed
        for rep in range(args.repeats):   # alternate, so that a drifting load weighs on each alike
            for name, cluster, front, batches_path in clusters:
                rounds_path = cluster.workdir / "drafter.rounds.jsonl"
                seen_b, seen_r = len(read_lines(batches_path)), len(read_lines(rounds_path))
                time.sleep(0.3)
                outputs, wall = sdcp_at_once(front, prompts, args.new_tokens, eos)
                time.sleep(0.3)   # the last lines land
                tokens = sum(map(len, outputs))
                rates[name].append(tokens / wall)
                summary = summarise(read_lines(batches_path)[seen_b:], read_lines(rounds_path)[seen_r:], wall)
                summaries[name].append(summary)
                print(f"\n[{name}, run {rep + 1}] {len(prompts)} prompts at once through the processes: "
                      f"{tokens} tokens in {wall:.2f} s, {tokens / wall:.1f} tokens/s; load average "
                      f"{os.getloadavg()[0]:.2f}\n{report(summary)}", flush=True)
            loop = in_process(target, draft, prompts, args.new_tokens, eos, args.m)
            loops.append(loop.rate)
            print(f"\n[run {rep + 1}] the speculative loop in this process: {loop.tokens} tokens, "
                  f"{loop.rate:.1f} tokens/s", flush=True)
    finally:
        for _, cluster, _, _ in clusters:
            cluster.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    loop_rate = statistics.median(loops)
    parts = []
    for name, _, _ in variants:
        rate = statistics.median(rates[name])
        per_pass = statistics.median(s["per_pass"] for s in summaries[name])
        busy = statistics.median(s["busy_share"] for s in summaries[name])
        parts.append(f"{name}: {rate:.1f} tok/s ({rate / loop_rate:.2f}x), {per_pass:.2f} sessions a pass, "
                     f"verifier busy {100 * busy:.0f}%")
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{len(prompts)} prompts, medians: one process {loop_rate:.1f} tok/s; " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
