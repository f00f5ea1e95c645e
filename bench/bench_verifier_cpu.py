"""The verifier's CPU per proposal, counted in instructions (callgrind), not timed.

Wall-clock and even CPU-second figures on a shared 2-core machine move by 2x with the load;
an instruction count of a fixed workload does not (callgrind counts what the guest executes,
whatever else the machine runs). So this runs one verifier process (`sdcp-fast serve
verifier`: table model, every token accepted, file commit log and embedded store on
/dev/shm, HTTP/2 or HTTP/3 with mutual TLS) under `valgrind --tool=callgrind` with
instrumentation off, drives every session through a warm-up from this process, turns
instrumentation on (`callgrind_control -i on`), sends a fixed number of proposals, turns it
off and reads the total: instructions per proposal, everything the verifier process does
for them included (TLS, HTTP framing, CBOR, validation, the engine, the commit-log append,
the verdict), worker threads too.

Side by side in one run: `--baseline REV` (default `main`) extracts that revision's
`sdcp_fast` with `git archive` and runs the same workload on it (PYTHONPATH ahead of the
editable install), then on this working tree.

With one session every round is a batch of one and the count repeats to within a fraction
of a percent; with more sessions the batcher's grouping depends on timing (callgrind slows
the verifier ~50x), so the table also gives jobs per batch.

    .venv/bin/python bench/bench_verifier_cpu.py [--proposals 200] [--sessions 1,8]
        [--protocols h2] [--baseline main] [--tool callgrind|cprofile] [--keep DIR]

The last line reads `verifier instructions per proposal: h2 1 session 12.3M -> 4.5M
(0.37x), ...` (baseline -> this tree).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.bench_round import DRAFTERS, M, V, open_session, table_target  # noqa: E402
from sdcp_fast import config as schema  # noqa: E402
from sdcp_fast.core.messages import Proposal, Status, Verdict  # noqa: E402
from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.procs import Cluster, die_with_parent  # noqa: E402
from sdcp_fast.transport import Client, TLSConfig, make_certs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class MeasuredCluster(Cluster):
    """A cluster whose verifier runs under callgrind (instrumentation off until `collect(True)`)
    or, with `tool="cprofile"`, under cProfile (on and off by SIGUSR1 / SIGUSR2)."""

    def __init__(self, workdir: Path, tree: Path | None, tool: str, inline_below_us: str, **kwargs):
        super().__init__(workdir, **kwargs)
        self.tree, self.tool, self.inline_below_us = tree, tool, inline_below_us
        self.out_file = workdir / ("callgrind.out" if tool == "callgrind" else "cprofile.out")

    def launch(self, instance) -> None:
        instance.config_path.write_text(schema.dumps(instance.config))
        instance.ready_path.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "SDCP_BENCH_PROFILE": str(self.out_file), "SDCP_INLINE_BELOW_US": self.inline_below_us}
        if self.tree is not None:
            env["PYTHONPATH"] = str(self.tree)
        serve = ["serve", instance.role, "--config", str(instance.config_path)]
        if self.tool == "callgrind":
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out_file}",
                       sys.executable, "-m", "sdcp_fast.cli", *serve]
        else:
            # `-c`, not this file: its sys.path entry would put this tree ahead of PYTHONPATH
            command = [sys.executable, "-c", PROFILED_SERVE, *serve]
        log = open(instance.log_path, "ab")  # noqa: SIM115 (the child owns it)
        instance.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=self.workdir, start_new_session=True,
                                          preexec_fn=die_with_parent())
        log.close()

    def collect(self, pid: int, on: bool) -> None:
        if self.tool == "callgrind":
            _control(pid, "-i", "on" if on else "off")
            if not on:
                _control(pid, "-d")
        else:
            os.kill(pid, signal.SIGUSR1 if on else signal.SIGUSR2)
        if not on:
            deadline = time.monotonic() + 120
            while not self.out_file.is_file() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)


PROFILED_SERVE = """
import cProfile, os, runpy, signal, sys
# the CLI under cProfile, on at SIGUSR1, off and dumped at SIGUSR2 (the event loop's thread
# only: worker threads are not profiled)
profile = cProfile.Profile()
def stop(*_):
    profile.disable()
    profile.dump_stats(os.environ["SDCP_BENCH_PROFILE"])
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, stop)
sys.argv = ["sdcp-fast", *sys.argv[1:]]
runpy.run_module("sdcp_fast.cli", run_name="__main__")
"""


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, stdout=subprocess.DEVNULL,
                   timeout=120)


def _total_ir(out_file: Path) -> int:
    """The `totals:` (or `summary:`) line of a callgrind output file, the last dump's."""
    total = None
    for path in [out_file, *sorted(out_file.parent.glob(out_file.name + ".*"))]:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith(("totals:", "summary:")):
                    total = int(line.split()[1])
    if total is None:
        raise RuntimeError(f"no totals in {out_file}")
    return total


async def _drive(url: str, certs: Path, router_uri: str, protocol: str, sessions: int, proposals: int,
                 next_token: list[int], backend_digests: tuple[bytes, bytes], on_warm) -> None:
    """Warm every session up (2 rounds each), call `on_warm`, then send `proposals` proposals,
    shared evenly across the sessions."""
    router = Client(TLSConfig.for_instance(str(certs), router_uri), protocol, timeout=600.0)
    client = Client(TLSConfig.for_instance(str(certs), DRAFTERS[0]), protocol, timeout=600.0)
    try:
        opened = await asyncio.gather(*(open_session(url, router, DRAFTERS[0], *backend_digests)
                                        for _ in range(sessions)))
        status = Status(DRAFTERS[0], 1, 10, 0, 2000)

        async def rounds(state: list, count: int) -> None:
            sid, round_, committed, digest, last = state
            m = M   # the verdict's m_cap bounds the next proposal
            for _ in range(count):
                tokens, t = [], last
                for _ in range(m):
                    t = next_token[t]
                    tokens.append(t)
                body = Proposal(sid, 1, round_ + 1, DRAFTERS[0], committed, digest, tuple(tokens), status).to_cbor()
                response = await client.request("POST", f"{url}proposals", body, idempotent=True)
                if response.status != 200:
                    raise RuntimeError(f"round refused: {response.status} {response.body[:200]!r}")
                verdict = Verdict.from_cbor(response.body)
                round_, committed, digest, last = verdict.round, verdict.committed, verdict.digest, verdict.emitted[-1]
                m = min(M, verdict.m_cap)
            state[:] = [sid, round_, committed, digest, last]

        states = [list(s) for s in opened]
        await asyncio.gather(*(rounds(s, 2) for s in states))
        await asyncio.to_thread(on_warm)
        shares = [proposals // sessions + (n < proposals % sessions) for n in range(sessions)]
        await asyncio.gather(*(rounds(s, n) for s, n in zip(states, shares, strict=True)))
    finally:
        await router.close()
        await client.close()


def measure(workdir: Path, tree: Path | None, spec: str, protocol: str, sessions: int, proposals: int,
            next_token: list[int], digests: tuple[bytes, bytes], keep: Path | None, label: str,
            tool: str, inline_below_us: str) -> dict:
    cluster = MeasuredCluster(workdir, tree, tool, inline_below_us, protocol=protocol, log_level="warning")
    verifier = cluster.verifier("verifier", model=spec, speculation="on", max_wait_ms=2.0, router_uri=None, metrics="127.0.0.1:0")
    make_certs(cluster.certs, [cluster.router_uri, *DRAFTERS])
    with cluster:
        cluster.start(timeout=600)
        url = f"https://127.0.0.1:{verifier.info['port']}/"
        marks = {}

        def on_warm():
            marks["batches0"] = _batches(verifier.info["metrics_port"])
            cluster.collect(verifier.pid, True)

        asyncio.run(_drive(url, cluster.certs, cluster.router_uri, protocol, sessions, proposals, next_token,
                           digests, on_warm))
        cluster.collect(verifier.pid, False)
        batches = _batches(verifier.info["metrics_port"]) - marks["batches0"]
    row = {"label": label, "protocol": protocol, "sessions": sessions,
           "jobs_per_batch": proposals / max(batches, 1)}
    name = f"{label.replace(' ', '-').replace('/', '-')}-{protocol}-{sessions}"
    if tool == "callgrind":
        row["ir"] = _total_ir(cluster.out_file) / proposals
    else:
        import pstats

        stats = pstats.Stats(str(cluster.out_file))
        row["calls"] = stats.total_calls / proposals
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            with open(keep / f"{name}.txt", "w") as f:
                pstats.Stats(str(cluster.out_file), stream=f).sort_stats("tottime").print_stats(60)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for path in workdir.glob(cluster.out_file.name + "*"):
            shutil.copy(path, keep / f"{name}.{path.name}")
    return row


def _batches(port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^sdcp_batch_size_count(?:\{[^}]*\})? (\S+)$", text, re.M))


def _extract(rev: str, into: Path) -> Path:
    """`rev`'s sdcp_fast under `into`, with this tree's build of the CBOR decoder's C fast
    path where `rev` has the same source for it (a build is not in git; without it the
    baseline would decode in Python alone and look slower than it is)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "sdcp_fast"], check=True,
                             stdout=subprocess.PIPE).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    source = "csrc/cbor/cbor_decode.c"
    same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", source]).returncode == 0
    if same and subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:{source}"],
                               stderr=subprocess.DEVNULL).returncode == 0:
        for built in (ROOT / "sdcp_fast" / "core").glob("_cbor_c*.so"):
            shutil.copy2(built, into / "sdcp_fast" / "core" / built.name)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposals", type=int, default=200, help="measured proposals per row")
    parser.add_argument("--sessions", default="1,8")
    parser.add_argument("--protocols", default="h2")
    parser.add_argument("--baseline", default="main", help="git revision to compare with ('' for none)")
    parser.add_argument("--tool", choices=("callgrind", "cprofile"), default="callgrind",
                        help="count instructions (callgrind) or Python calls (cprofile, the loop's thread)")
    parser.add_argument("--inline-below-us", default="1000000000",
                        help="SDCP_INLINE_BELOW_US for the verifier (default: every forward pass and verify "
                             "launch that Offload measures runs on the loop, as a table model's do on a quiet "
                             "machine; under callgrind every call is ~50x slower, so 300 would send them all "
                             "to threads); 0: every call in a worker thread")
    parser.add_argument("--keep", type=Path, help="keep the profiler's output files here (cprofile: top 60 too)")
    args = parser.parse_args()
    if args.tool == "callgrind" and shutil.which("valgrind") is None:
        print("valgrind not found (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    key, unit = ("ir", "instructions") if args.tool == "callgrind" else ("calls", "Python calls")
    scale, suffix = (1e6, "M") if args.tool == "callgrind" else (1.0, "")
    protocols = args.protocols.split(",")
    sessions = [int(s) for s in args.sessions.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sdcp-vcpu-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                     else None) as tmp:
        workdir = Path(tmp)
        table, spec = table_target(workdir)
        backend = load_backend(spec)
        digests = (backend.digest, backend.tokenizer_digest)
        next_token = table.argmax(dim=1).tolist()
        trees = [("this tree", None)]
        if args.baseline:
            trees.insert(0, (args.baseline, _extract(args.baseline, workdir / "baseline")))
        for protocol in protocols:
            for n in sessions:
                for label, tree in trees:
                    row = measure(workdir / f"run-{len(rows)}", tree, spec, protocol, n, args.proposals,
                                  next_token, digests, args.keep, label, args.tool, args.inline_below_us)
                    rows.append(row)
                    print(f"{label} {protocol} {n}: {row[key] / scale:.2f}{suffix} {unit} per proposal",
                          file=sys.stderr)
    print(f"load average {os.getloadavg()[0]:.1f} (counts do not depend on it); table model V={V}, M={M}, "
          f"every token accepted; {args.proposals} proposals per row; {args.tool}; "
          f"SDCP_INLINE_BELOW_US={args.inline_below_us}\n")
    print(f"| tree | protocol | sessions | {unit} per proposal | jobs/batch |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['label']} | {r['protocol']} | {r['sessions']} | {r[key] / scale:.2f}{suffix} | "
              f"{r['jobs_per_batch']:.1f} |")
    parts = []
    for protocol in protocols:
        for n in sessions:
            mine = [r[key] for r in rows if r["protocol"] == protocol and r["sessions"] == n]
            what = f"{protocol} {n} session{'s' * (n > 1)} {mine[0] / scale:.2f}{suffix}"
            if len(mine) == 2:
                what += f" -> {mine[1] / scale:.2f}{suffix} ({mine[1] / mine[0]:.2f}x)"
            parts.append(what)
    print(f"\nverifier {unit} per proposal{' (baseline -> this tree)' if args.baseline else ''}: "
          + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
