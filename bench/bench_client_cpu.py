"""The drafter side's CPU per proposal (the SDCP client: build + encode a proposal, the HTTP/2
or HTTP/3 client, decode the verdict), counted, not timed.

One verifier process (table model, every token accepted, as in bench_round.py) serves one
session driven by a client process that this script starts: it warms the session up, then
sends `--proposals` proposals one after another and reports, for those only, its CPU seconds
per proposal and, with `--tool cprofile`, the Python calls per proposal (top functions with
`--keep`), or, with `--tool callgrind`, the instructions per proposal (the client process
runs under valgrind with instrumentation off until the warm-up is done; a count does not
move with the machine's load the way CPU seconds do).

    .venv/bin/python bench/bench_client_cpu.py [--protocols h2,h3] [--proposals 2000]
        [--tool cpu|cprofile|callgrind] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tree measured: this one, or the baseline's extracted sdcp_fast (ahead of the editable install)
sys.path.insert(0, os.environ.get("SDCP_BENCH_TREE") or str(ROOT))
M = 4


async def open_session(verifier: str, router, drafter: str, target: bytes, tokenizer: bytes):
    """bench_round.open_session without its torch import: (session id, round, committed, digest, last)."""
    from sdcp_fast.core.digest import prefix_digest
    from sdcp_fast.core.messages import Action, Assignment, Contract, SessionOpen, SessionState
    from sdcp_fast.refs import commit_log_name, encode_session_id
    from sdcp_fast.transport import call

    contract = Contract(target=target, tokenizer=tokenizer, rule=1, m_max=8, max_new=1 << 30, stop=(),
                        low_rounds=4, fallback=(Action.REDUCE,))
    sid = os.urandom(16)
    prompt = (1, 2, 3)
    opened = SessionOpen(sid, 1, contract, prompt, commit_log_name(sid))
    state = (await call(router, "POST", f"{verifier}sessions", opened, SessionState)).message
    d0 = prefix_digest(contract.digest, prompt)
    assignment = Assignment(sid, 1, contract, verifier, drafter, prompt, 0, 0, d0, 8)
    reply = await call(router, "PUT", f"{verifier}sessions/{encode_session_id(sid)}/drafter", assignment,
                       SessionState)
    assert reply.ok, reply.detail
    return sid, state.round, 0, d0, prompt[-1]


async def _drive(args: argparse.Namespace) -> dict:
    """The client process: no torch here (it would cost a minute under valgrind)."""
    from sdcp_fast.core.messages import Proposal, Status, Verdict
    from sdcp_fast.transport import Client, TLSConfig

    setup = json.loads(Path(args.drive).read_text())
    next_token = setup["next_token"]
    drafter = setup["drafter"]
    router = Client(TLSConfig.for_instance(setup["certs"], setup["router_uri"]), setup["protocol"], timeout=600.0,
                    connect_timeout=600.0)
    client = Client(TLSConfig.for_instance(setup["certs"], drafter), setup["protocol"], timeout=600.0,
                    connect_timeout=600.0)
    url = setup["url"]
    try:
        sid, round_, committed, digest, last = await open_session(
            url, router, drafter, bytes.fromhex(setup["target"]), bytes.fromhex(setup["tokenizer"]))
        status = Status(drafter, 1, 10, 0, 2000)
        proposals_url = f"{url}proposals"
        m = M

        async def rounds(count: int) -> None:
            nonlocal round_, committed, digest, last, m
            for _ in range(count):
                tokens, t = [], last
                for _ in range(m):
                    t = next_token[t]
                    tokens.append(t)
                body = Proposal(sid, 1, round_ + 1, drafter, committed, digest, tuple(tokens), status).to_cbor()
                response = await client.request("POST", proposals_url, body, idempotent=True)
                if response.status != 200:
                    raise RuntimeError(f"round refused: {response.status} {response.body[:200]!r}")
                verdict = Verdict.from_cbor(response.body)
                round_, committed, digest, last = (verdict.round, verdict.committed, verdict.digest,
                                                   verdict.emitted[-1])
                m = min(M, verdict.m_cap)

        await rounds(20)
        profile = None
        if setup["tool"] == "callgrind":
            control = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())],
                                       stdout=subprocess.DEVNULL)
            while control.poll() is None:   # valgrind takes the command while this process runs
                await asyncio.sleep(0.01)
        elif setup["tool"] == "cprofile":
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        cpu0 = time.process_time()
        await rounds(setup["proposals"])
        cpu = time.process_time() - cpu0
        if profile is not None:
            profile.disable()
            profile.dump_stats(setup["out"])
        if setup["tool"] == "callgrind":
            subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], stdout=subprocess.DEVNULL)
            subprocess.run(["callgrind_control", "-d", str(os.getpid())], stdout=subprocess.DEVNULL)
        return {"cpu_ms": 1e3 * cpu / setup["proposals"]}
    finally:
        await router.close()
        await client.close()


def measure(workdir: Path, protocol: str, args: argparse.Namespace, tree: Path | None, label: str) -> dict:
    from bench.bench_round import DRAFTERS, table_target
    from sdcp_fast.models import load_backend
    from sdcp_fast.procs import Cluster
    from sdcp_fast.transport import make_certs

    table, spec = table_target(workdir)
    backend = load_backend(spec)
    cluster = Cluster(workdir / f"{label}-{protocol}", protocol=protocol, log_level="warning")
    verifier = cluster.verifier("verifier", model=spec, speculation="on", max_wait_ms=2.0, router_uri=None)
    make_certs(cluster.certs, [cluster.router_uri, *DRAFTERS])
    out = workdir / f"{label}-{protocol}.out"
    setup = {"next_token": table.argmax(dim=1).tolist(), "drafter": DRAFTERS[0], "certs": str(cluster.certs),
             "router_uri": cluster.router_uri, "protocol": protocol, "target": backend.digest.hex(),
             "tokenizer": backend.tokenizer_digest.hex(), "proposals": args.proposals, "tool": args.tool,
             "out": str(out)}
    with cluster:
        saved = os.environ.get("PYTHONPATH")
        if tree is not None and args.baseline_server:   # the verifier from the same tree as the client
            os.environ["PYTHONPATH"] = str(tree)
        try:
            cluster.start(timeout=60)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        setup["url"] = f"https://127.0.0.1:{verifier.info['port']}/"
        setup_file = workdir / f"{label}-{protocol}.json"
        setup_file.write_text(json.dumps(setup))
        command = [sys.executable, str(Path(__file__).resolve()), "--drive", str(setup_file)]
        if args.tool == "callgrind":
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                       *command]
        env = {**os.environ, "SDCP_BENCH_TREE": str(tree)} if tree is not None else None
        result = subprocess.run(command, check=True, stdout=subprocess.PIPE, env=env, cwd=workdir)
    row = {"label": label, "protocol": protocol, **json.loads(result.stdout.decode().strip().splitlines()[-1])}
    if args.tool == "cprofile":
        import pstats

        stats = pstats.Stats(str(out))
        row["calls"] = stats.total_calls / args.proposals
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"{label}-{protocol}.cprofile.out").write_bytes(out.read_bytes())
            with open(args.keep / f"{label}-{protocol}.txt", "w") as f:
                pstats.Stats(str(out), stream=f).sort_stats("tottime").print_stats(50)
                pstats.Stats(str(out), stream=f).sort_stats("cumulative").print_stats(50)
    elif args.tool == "callgrind":
        from bench.bench_verifier_cpu import _total_ir

        row["ir"] = _total_ir(out) / args.proposals
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for path in workdir.glob(out.name + "*"):
                (args.keep / f"{label}-{protocol}.{path.name}").write_bytes(path.read_bytes())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", default="h2,h3")
    parser.add_argument("--proposals", type=int, default=2000)
    parser.add_argument("--tool", choices=("cpu", "cprofile", "callgrind"), default="cpu")
    parser.add_argument("--baseline", default="", help="git revision to compare with (its sdcp_fast)")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--baseline-server", action="store_true",
                        help="the baseline's rows run the baseline's verifier too (else this tree's)")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        from sdcp_fast import aio

        print(json.dumps(aio.run(_drive(args))))
        return 0
    from bench.bench_verifier_cpu import _extract

    rows = []
    with tempfile.TemporaryDirectory(prefix="sdcp-ccpu-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                     else None) as tmp:
        workdir = Path(tmp)
        trees = [("this", None)]
        if args.baseline:
            trees.insert(0, (args.baseline, _extract(args.baseline, workdir / "baseline")))
        for protocol in args.protocols.split(","):
            for label, tree in trees:
                row = measure(workdir, protocol, args, tree, label)
                rows.append(row)
                extra = (f", {row['calls']:.0f} Python calls" if "calls" in row else
                         f", {row['ir'] / 1e6:.3f}M instructions" if "ir" in row else "")
                print(f"{label} {protocol}: client CPU {row['cpu_ms']:.3f} ms per proposal{extra}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.proposals} proposals, one session; tool {args.tool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
