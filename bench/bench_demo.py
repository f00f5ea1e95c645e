"""`sdcp-fast demo` measured: SDCP through real processes vs the target alone, side by side.

    .venv/bin/python bench/bench_demo.py [--repeats 3] [--prompts 4] [--max-new 96] [--protocol h2]
    .venv/bin/python bench/bench_demo.py --round-latency     # protocol cost of one round

Each repeat runs the whole demo (router, verifier, two drafters as processes with mutual
TLS on loopback, the demo pair under rule 1, the prompts at once), then decodes the same
prompts with the target alone in one process (greedy, the prompts batched, one forward pass
per token, one thread like each serving process). Prints a markdown table per repeat and the
medians; the speedup is SDCP tokens/s over target-alone tokens/s from the same repeat.

--round-latency measures what one SDCP round costs when the models cost nothing: a table
target (logits looked up, no arithmetic), its own table as the draft, one session, the same
processes and transport; it prints the median time per round and from proposal to verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast import demo  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--protocol", choices=["h2", "h3"], default="h2")
    parser.add_argument("--round-latency", action="store_true")
    args = parser.parse_args()
    if args.round_latency:
        return round_latency(args.protocol)

    rows = []
    for n in range(args.repeats):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code, summary = demo.run(protocol=args.protocol, prompts=args.prompts, max_new=args.max_new)
        if code != 0 or not summary:
            print(out.getvalue())
            print(f"repeat {n + 1} failed (exit {code})", file=sys.stderr)
            return 1
        rows.append(summary)
        print(f"repeat {n + 1}: speedup {summary['speedup']:.2f}x", file=sys.stderr)

    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
          f"python {platform.python_version()}; protocol {args.protocol}; {args.prompts} prompts x "
          f"{args.max_new} tokens\n")
    print("| repeat | tokens | SDCP tok/s | alone, batched tok/s | speedup | alone, one by one tok/s | "
          "speedup | tokens/round | acceptance | escalations | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, r in enumerate(rows):
        print(f"| {n + 1} | {r['tokens']} | {r['sdcp_tokens_per_s']:.1f} | {r['alone_tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['alone_each_tokens_per_s']:.1f} | {r['speedup_each']:.2f}x | "
              f"{r['tokens_per_round']:.2f} | {r['acceptance']:.0%} | {r['escalations']} | "
              f"{r['identical']}/{args.prompts} |")
    keys = ("sdcp_tokens_per_s", "alone_tokens_per_s", "speedup", "alone_each_tokens_per_s", "speedup_each",
            "tokens_per_round", "acceptance")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"| median | | {med['sdcp_tokens_per_s']:.1f} | {med['alone_tokens_per_s']:.1f} | "
          f"{med['speedup']:.2f}x | {med['alone_each_tokens_per_s']:.1f} | {med['speedup_each']:.2f}x | "
          f"{med['tokens_per_round']:.2f} | {med['acceptance']:.0%} | | |")
    return 0


def round_latency(protocol: str, tokens: int = 200) -> int:
    import json
    import tempfile
    import time

    import httpx
    import torch

    from sdcp_fast.models import load_backend
    from sdcp_fast.models.table import write_table
    from sdcp_fast.procs import Cluster

    with tempfile.TemporaryDirectory(prefix="sdcp-latency-", dir="/dev/shm") as tmp:
        table = Path(tmp) / "table.safetensors"
        write_table(table, torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
        spec = f"table:{table}"
        cluster = Cluster(Path(tmp) / "cluster", protocol=protocol)
        cluster.verifier("verifier", model=spec, speculation="on", max_wait_ms=1.0)
        cluster.drafter("drafter", model=spec)
        cluster.router(model=spec, drafter_models={"drafter": load_backend(spec).digest.hex()},
                       contract={"rule": 1, "m_max": 4, "max_new": tokens})
        with cluster:
            cluster.start()
            front = cluster.instances["router"].frontdoor_url
            demo.wait_live(front, 2, timeout=30)
            started = time.perf_counter()
            with httpx.stream("POST", f"{front}/v1/generate", json={"tokens": [1, 2, 3]}, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
            wall = time.perf_counter() - started
        records = [json.loads(x) for x in (cluster.workdir / "drafter.rounds.jsonl").read_text().splitlines()]
    times = [b["t"] - a["t"] for a, b in zip(records, records[1:], strict=False)]
    print(f"protocol {protocol}, table model (free), one session, {tokens} tokens, {len(records)} rounds "
          f"(all M tokens accepted): {1000 * statistics.median(times):.1f} ms per round (median), "
          f"{1000 * wall / len(records):.1f} ms per round overall, proposal->verdict EWMA at the end "
          f"{records[-1]['verify_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
