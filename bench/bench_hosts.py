"""A deployment across test hosts with distance between drafters and verifier (issue 36).

    flock /tmp/sdcp-quiet.lock .venv/bin/python bench/bench_hosts.py [--sessions 16] [--max-new 64]
        [--rtts 0.1,2,10,30] [--out bench/hosts_runs.json] [--protocol h3 --loss 0.01]
        [--target hf:smollm2 --draft twin:smollm2]

Needs root and `ip netns` (sdcp_fast/hosts). Hosts: a router, a verifier and 3 etcd members
(commit log and session table) on the near wire; two drafters on the far wire; the relay host
between the wires (sdcp_fast/hosts/relay.py) forwards TCP and UDP after RTT/2 each way. The
pair is by default the byte-level demo pair (tiny:demo-target, tiny:demo-draft: a stand-in on
2 cores; the real SmolLM2 pair, --target hf:smollm2 --draft twin:smollm2, spends minutes per
point at 16 sessions), rule 1, the demo's deployment plan (speculation "on").

It measures, in order:
1. the relay's own cost: TCP and UDP round trips between two hosts on one wire, then through
   the relay at zero added delay, then at each RTT's delay (what the RTT really is);
2. at each RTT (0.1 ms: the relay with no added delay, its own cost being about that), with
   the drafters drafting ahead (`draft_ahead`, the drafter prepares the next proposal during
   verification on the all-accepted verdict and throws it away otherwise) and without:
   `--sessions` streams at once and one stream alone (the median of `--repeats` runs, and of
   `--repeats-one` for one stream: one short run is noisy; the repeats go round drafting
   ahead and not and round the RTTs, so that a slow minute of the shared machine falls on
   every point alike, and a run during which more CPU went outside the deployment than
   `--busy-cores` is measured again); tokens/s (all streams' tokens over the wall time),
   inter-token latency (per stream, (last - first token) / (tokens - 1); the median over
   streams), time to first token, every output checked against the target's greedy decoding;
3. faults during live generations, each ending with every output exact: the verifier host
   cut off (link down) for 1.5 s and back (inside its TTL: the same verifier carries on); an
   etcd member other than the leader killed (started again once the streams ended); the etcd
   leader's host cut off from the other two for 3 s and back (each role talks to one member:
   those on the leader's wait for it); a drafter host cut off for good (its sessions go to the
   other drafter);
4. the CPU seconds each process spent per committed token (router, verifier, drafters,
   etcd members; from /proc) and the etcd cluster's append rate, for bench/fleet_sim.py.

The drafters' rounds logs (m, accepted, draft and turnaround times, look-ahead drafted and
used, alpha and m_cap), the draft's greedy matches of each prompt's target output by position
(what rule 1 accepts), the verifier's batch log (jobs, tokens, pass time, a job's time in the
verifier) and the figures go to `--out` (JSON), which bench/fleet_sim.py calibrates from. The
last line is the summary:
`hosts: N hosts, RTT 0.1/2/10/30 ms: 16-session tokens/s A/B/C/D (ahead) vs E/F/G/H (not
ahead); faults K/K exact`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast.demo import PROMPTS, deployment  # noqa: E402
from sdcp_fast.demo.baseline import decode_alone  # noqa: E402
from sdcp_fast.drafter import rounds_from_file  # noqa: E402
from sdcp_fast.hosts.netns import Network, unavailable  # noqa: E402
from sdcp_fast.hosts.relay import RelayProcess  # noqa: E402
from sdcp_fast.hosts.testbed import Testbed  # noqa: E402
from sdcp_fast.models import load_backend  # noqa: E402

TARGET, DRAFT = "tiny:demo-target", "tiny:demo-draft"
ROUND_FIELDS = ("m", "accepted", "emitted", "draft_ms", "verify_ms", "ahead", "session", "drafted_ahead",
                "turnaround_ms", "verifier_ms", "alpha", "m_cap")
BATCH_FIELDS = ("jobs", "tokens", "pass_ms", "residence_ms")
HOSTS = ["router", "verifier", "drafter-1", "drafter-2"]
FAR = ["drafter-1", "drafter-2"]

# ---------------------------------------------------------------------- the relay's own cost

PING_SERVER = """
import socket, sys, threading
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((sys.argv[1], 8443))
def udp():
    while True:
        d, p = u.recvfrom(65536); u.sendto(d, p)
threading.Thread(target=udp, daemon=True).start()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 8443)); s.listen(); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(65536)):
        c.sendall(d)
    c.close()
"""

PING_CLIENT = """
import json, socket, statistics, sys, time
s = socket.create_connection((sys.argv[1], 8443), 5); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.settimeout(5)
def tcp():
    t = time.perf_counter(); s.sendall(b"x" * 300); n = 0
    while n < 300:
        n += len(s.recv(65536))
    return time.perf_counter() - t
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5); u.connect((sys.argv[1], 8443))
def udp():
    t = time.perf_counter(); u.send(b"y" * 300); u.recv(65536); return time.perf_counter() - t
n = int(sys.argv[2])
for f in (tcp, udp):
    for _ in range(10):
        f()
print(json.dumps({"tcp_ms": 1e3 * statistics.median(tcp() for _ in range(n)),
                  "udp_ms": 1e3 * statistics.median(udp() for _ in range(n))}))
"""


def ping(net: Network, src: str, dst: str, n: int) -> dict:
    out = subprocess.run([*net.wrap(src), sys.executable, "-c", PING_CLIENT, net.address(dst), str(n)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-800:])
    return json.loads(out.stdout)


def relay_cost(workdir: Path, delays_ms: list[float], n: int = 300) -> dict:
    """Round trips (median, ms) on one wire, and through the relay at each one-way delay."""
    out: dict = {}
    with Network(["a", "b"]) as net:
        server = subprocess.Popen([*net.wrap("a"), sys.executable, "-c", PING_SERVER, net.address("a")],
                                  stdout=subprocess.PIPE)
        try:
            server.stdout.readline()
            out["direct"] = ping(net, "b", "a", n)
        finally:
            server.kill()
            server.wait(5)
    with Network(["a", "b"], far=["b"], relay=True) as net:
        server = subprocess.Popen([*net.wrap("a"), sys.executable, "-c", PING_SERVER, net.address("a")],
                                  stdout=subprocess.PIPE)
        try:
            server.stdout.readline()
            for delay in delays_ms:
                relay = RelayProcess(net, delay, workdir / "relay-cost.log")
                relay.start()
                try:
                    out[f"relay {delay:g}"] = ping(net, "b", "a", n if delay < 5 else max(50, n // 5))
                finally:
                    relay.stop()
        finally:
            server.kill()
            server.wait(5)
    return out


# ---------------------------------------------------------------------- streams


@dataclasses.dataclass
class Stream:
    prompt: list[int]
    gid: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    error: str | None = None

    @property
    def itl_ms(self) -> float | None:
        if len(self.times) < 2 or len(self.tokens) < 2:
            return None
        return 1000 * (self.times[-1] - self.times[0]) / (len(self.tokens) - 1)


def stream(front: str, s: Stream, max_new: int) -> None:
    try:
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as http, \
                http.stream("POST", f"{front}/v1/generate", json={"tokens": s.prompt, "max_new": max_new}) as r:
            r.raise_for_status()
            name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:") and name in ("start", "tokens", "end"):
                    data = json.loads(line[5:])
                    if name == "start":
                        s.gid = data["id"]
                    elif name == "tokens":
                        assert data["index"] == len(s.tokens), "a gap or a repeat in the stream"
                        s.tokens.extend(data["tokens"])
                        s.times.append(time.perf_counter())
                    else:
                        s.finish = data["finish"]
                        return
    except Exception as exc:     # reported with the run; the benchmark carries on
        s.error = f"{type(exc).__name__}: {exc}"


def run_streams(front: str, prompts: list[list[int]], max_new: int, during=None) -> tuple[list[Stream], float]:
    streams = [Stream(p) for p in prompts]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(streams) + 1) as pool:
        futures = [pool.submit(stream, front, s, max_new) for s in streams]
        if during is not None:
            during(streams)
        for f in futures:
            f.result(timeout=600)
    return streams, time.perf_counter() - started


def exact(streams: list[Stream], reference: dict[tuple, list[int]]) -> bool:
    return all(s.finish == "finish" and not s.error and s.tokens == reference[tuple(s.prompt)] for s in streams)


# ---------------------------------------------------------------------- the deployment


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all processes, all cores; /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu(bed: Testbed) -> dict[str, float]:
    out = {name: cpu_seconds(i.pid) for name, i in bed.cluster.instances.items() if i.alive()}
    for host, popen in bed.etcd.processes.items():
        if popen.poll() is None:
            out[host] = cpu_seconds(popen.pid)
    if bed.relay is not None and bed.relay.popen is not None and bed.relay.popen.poll() is None:
        out["relay"] = cpu_seconds(bed.relay.popen.pid)
    return out


def restart_drafters(bed: Testbed, ahead: bool) -> None:
    cluster = bed.cluster
    drafters = [i for i in cluster.instances.values() if i.role == "drafter"]
    for d in drafters:
        d.stop()
        d.config = dataclasses.replace(d.config, drafter=dataclasses.replace(d.config.drafter, draft_ahead=ahead))
        cluster.launch(d)
    cluster.wait_ready(drafters, 60)
    deployment_live(bed)


def deployment_live(bed: Testbed, count: int | None = None) -> None:
    from sdcp_fast.demo.client import wait_live

    wait_live(bed.cluster.instances["router"].frontdoor_url, count or len(bed.cluster.instances) - 1, timeout=60)
    time.sleep(1.0)        # one more status round: the router's view of loads settles


def set_delay(bed: Testbed, delay_ms: float, loss: float = 0.0) -> None:
    bed.relay.stop()
    bed.relay = RelayProcess(bed.net, delay_ms, bed.workdir / "relay.log", loss=loss)
    bed.relay.start()
    bed.delay_ms = delay_ms
    deployment_live(bed)


def rounds_since(bed: Testbed, since: float) -> list[dict]:
    out = []
    for name in FAR:
        path = bed.cluster.workdir / f"{name}.rounds.jsonl"
        if path.is_file():
            out += [r for r in rounds_from_file(path) if r["t"] >= since and not r.get("dropped")]
    return out


def etcd_append_rate(spec: str, seconds: float = 3.0, concurrency: int = 16) -> float:
    """Commit-log appends per second on the etcd cluster (each its own log, `concurrency` at once)."""
    from sdcp_fast.cache import open_log

    async def go() -> float:
        log = await open_log(spec)
        done = 0
        stop = time.perf_counter() + seconds

        async def writer(n: int) -> None:
            nonlocal done
            length, name = 0, f"log/bench-{uuid.uuid4().hex}-{n}"
            while time.perf_counter() < stop:
                length = await log.append(name, b"r" * 200, epoch=1, expected=length)
                done += 1
        try:
            started = time.perf_counter()
            await asyncio.gather(*(writer(n) for n in range(concurrency)))
            return done / (time.perf_counter() - started)
        finally:
            await log.close()
    return asyncio.run(go())


def batches_since(bed: Testbed, since: float) -> list[dict]:
    path = bed.cluster.workdir / "verifier.batches.jsonl"
    if not path.is_file():
        return []
    return [b for b in map(json.loads, path.read_text().splitlines()) if b["t"] >= since]


def measure(bed: Testbed, front: str, prompts: list[list[int]], max_new: int) -> dict:
    """One run of len(prompts) streams: the streams, wall time, CPU seconds per process, the
    drafters' rounds and the verifier's batches of that run."""
    since = time.time()
    before, busy = process_cpu(bed), machine_busy_s()
    started = time.perf_counter()
    streams, wall = run_streams(front, prompts, max_new)
    after, busy = process_cpu(bed), machine_busy_s() - busy
    time.sleep(0.05)                  # the last lines of the logs
    cpu = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"streams": streams, "started": started, "wall": wall, "cpu": cpu,
            # the machine's work outside the deployment (this client's threads included): a
            # run the machine's other users took cores from shows here
            "outside_cpu_s": max(0.0, busy - sum(cpu.values())),
            "rounds": rounds_since(bed, since), "batches": batches_since(bed, since)}


def summarize(reps: list[dict], reference: dict) -> dict:
    """A point from its repeats: tokens/s the median of the runs', ITL and TTFT the median over
    every stream; rounds and batches as rows (ROUND_FIELDS, BATCH_FIELDS) for fleet_sim."""
    streams = [s for rep in reps for s in rep["streams"]]
    rates = [sum(len(s.tokens) for s in rep["streams"]) / rep["wall"] for rep in reps]
    itls = [s.itl_ms for s in streams if s.itl_ms is not None]
    ttfts = [1000 * (s.times[0] - rep["started"]) for rep in reps for s in rep["streams"] if s.times]
    cpu: dict[str, float] = {}
    for rep in reps:
        for k, v in rep["cpu"].items():
            cpu[k] = cpu.get(k, 0.0) + v
    rounds, batches = [], []
    for n, rep in enumerate(reps):
        # a proposal's time in the verifier (queued, then its batch's pass and commit), by
        # (session, round): the rest of its turnaround is the wire and the protocol's overhead
        inside = {(sid, rnd): w + 1000 * (b["end"] - b["t"]) for b in rep["batches"]
                  for sid, rnd, w in zip(b["sessions"], b["rounds"], b["waited_ms"], strict=True)}
        ids: dict[str, int] = {}
        for r in rep["rounds"]:
            sid = ids.setdefault(r["session"], 1000 * n + len(ids))
            resident = inside.get((r["session"], r["round"]))
            rounds.append([r["m"], r["accepted"], r["emitted"], r["draft_ms"], r["verify_ms"], int(bool(r["ahead"])),
                           sid, r.get("drafted_ahead", 0),
                           round(1000 * (r["answered_at"] - r["sent_at"]), 3) if r.get("sent_at") else None,
                           None if resident is None else round(resident, 3), r.get("alpha"), r.get("m_cap")])
        for b in rep["batches"]:
            residence = [w + 1000 * (b["end"] - b["t"]) for w in b["waited_ms"]]
            batches.append([len(b["m"]), sum(m + 1 for m in b["m"]), round(1000 * (b["end"] - b["t"]), 3),
                            round(statistics.median(residence), 3)])
    used = [r for r in rounds if r[5]]
    return {"repeats": len(reps), "tokens": sum(len(s.tokens) for s in streams),
            "outside_cpu_per_s": sum(rep["outside_cpu_s"] for rep in reps) / sum(rep["wall"] for rep in reps),
            # every stream: first token, inter-token latency and last token (ms from its run's start)
            "streams": [[round(1000 * (s.times[0] - rep["started"]), 1), round(s.itl_ms or 0.0, 3),
                         round(1000 * (s.times[-1] - rep["started"]), 1)] for rep in reps for s in rep["streams"]
                        if s.times],
            "wall_s": sum(rep["wall"] for rep in reps), "tokens_per_s": statistics.median(rates),
            "tokens_per_s_runs": rates, "itl_ms": statistics.median(itls) if itls else None,
            "ttft_ms": statistics.median(ttfts) if ttfts else 0.0,
            "exact": exact(streams, reference), "cpu_s": cpu,
            "lookahead_used": len(used) / max(1, len(rounds)), "rounds": rounds, "batches": batches}


def draft_matches(draft, prompts: list[list[int]], outputs: list[list[int]]) -> list[str]:
    """Per prompt, by position of the target's greedy output: "1" where the draft's greedy
    token, given the target's output so far, is the target's token, else "0". Rule 1 drafts
    greedily, so a round proposing M tokens at position c accepts the run of "1"s from c, up
    to M: acceptance is a property of the text (bench/fleet_sim.py models it so)."""
    import torch

    ids = [f"match-{n}".encode() for n in range(len(prompts))]
    for sid, prompt in zip(ids, prompts, strict=True):
        draft.open(sid, prompt)
    out = [[] for _ in prompts]
    try:
        for k in range(max(map(len, outputs))):
            live = [n for n in range(len(prompts)) if k < len(outputs[n])]
            logits = draft.score([(ids[n], []) for n in live])
            for row, n in enumerate(live):
                out[n].append("1" if int(torch.argmax(logits[row])) == outputs[n][k] else "0")
                draft.commit(ids[n], [outputs[n][k]])
    finally:
        for sid in ids:
            draft.release(sid)
    return ["".join(m) for m in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--rtts", default="0.1,2,10,30", help="round trips in ms (0.1: the relay without delay)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("hosts_runs.json")))
    parser.add_argument("--repeats", type=int, default=5, help="runs per point (the median is reported)")
    parser.add_argument("--repeats-one", type=int, default=None,
                        help="runs per 1-session point (default 3 x --repeats: they are short, and noisier)")
    parser.add_argument("--busy-cores", type=float, default=0.1,
                        help="a run with more CPU than this plus 0.01 per session outside the deployment "
                             "(cores; this client's threads and the kernel's packet work included) is "
                             "measured again")
    parser.add_argument("--busy-retries", type=int, default=2, help="times a busy run is measured again")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--target", default=TARGET, help="the target (hf:smollm2: the real pair's)")
    parser.add_argument("--draft", default=DRAFT, help="the drafters' model (twin:smollm2 with hf:smollm2)")
    parser.add_argument("--protocol", default="h2", choices=("h2", "h3"), help="how the roles call each other")
    parser.add_argument("--loss", type=float, default=0.0,
                        help="fraction of UDP datagrams the relay drops (HTTP/3's; TCP is never altered)")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"bench_hosts: test hosts cannot be made here: {reason}", file=sys.stderr)
        return 2
    rtts = [float(r) for r in args.rtts.split(",")]
    delays = {rtt: (0.0 if rtt <= 0.1 else rtt / 2) for rtt in rtts}
    target = load_backend(args.target)
    draft = load_backend(args.draft)
    prompts = [target.encode(PROMPTS[n % len(PROMPTS)] + " " * (n // len(PROMPTS))) for n in range(args.sessions)]
    outputs, alone_s = decode_alone(target, prompts, [args.max_new] * len(prompts))
    reference = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
    one_repeats = args.repeats_one if args.repeats_one is not None else 3 * args.repeats
    record: dict = {"target": args.target, "draft": args.draft, "round_fields": ROUND_FIELDS, "batch_fields": BATCH_FIELDS, "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
                    "sessions": args.sessions, "max_new": args.max_new, "target_alone_tokens_per_s":
                    sum(map(len, outputs)) / alone_s, "runs": [], "faults": [],
                    "match": draft_matches(draft, prompts, outputs)}
    print(f"target alone (one process, {args.sessions} prompts batched): "
          f"{record['target_alone_tokens_per_s']:.0f} tokens/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="sdcp-hosts-", dir=deployment.fast_tmp()) as tmp:
        workdir = Path(tmp)
        record["relay"] = relay_cost(workdir, sorted(set(delays.values())))
        for name, r in record["relay"].items():
            print(f"round trip {name:>10}: TCP {r['tcp_ms']:.3f} ms, UDP {r['udp_ms']:.3f} ms", flush=True)

        with Testbed(workdir / "bed", hosts=HOSTS, far=FAR, delay_ms=0.0, protocol=args.protocol) as bed:
            # a model whose passes take 100 ms (the real pair on these cores): TTLs with room
            deployment.plan(bed.cluster, args.target, args.draft, draft.digest.hex(), args.max_new, speculation="on",
                            slow=args.target.startswith("hf:"))
            v = bed.cluster.instances["verifier"]     # one JSON line per verify batch: the pass costs
            v.config = dataclasses.replace(v.config, verifier=dataclasses.replace(
                v.config.verifier, batch_log=str(bed.cluster.workdir / "verifier.batches.jsonl")))
            for d in FAR:      # room for 16 sessions per drafter
                i = bed.cluster.instances[d]
                i.config = dataclasses.replace(i.config, drafter=dataclasses.replace(i.config.drafter,
                                                                                    max_sessions=64))
            bed.start()
            deployment_live(bed)
            n_hosts = len(bed.net.hosts) + 1        # the relay host too
            front = bed.cluster.instances["router"].frontdoor_url
            run_streams(front, prompts[:2], 16)     # warm-up: first connections, first passes
            # repeats interleaved over drafting ahead and not and over the RTTs (not all of
            # one, then the next): what else the machine is doing drifts over minutes and
            # would otherwise favour one
            points: dict[tuple[bool, float, int], list] = {}
            discarded: dict[tuple[bool, float, int], int] = {}
            for n in range(args.repeats):
                for ahead in (True, False):
                    restart_drafters(bed, ahead)
                    for rtt in rtts:
                        set_delay(bed, delays[rtt], args.loss)
                        # the 1-session runs spread evenly over the rounds of repeats
                        ones = one_repeats * (n + 1) // args.repeats - one_repeats * n // args.repeats
                        for count in [args.sessions] + [1] * ones:
                            key = (ahead, rtt, count)
                            for attempt in range(args.busy_retries + 1):
                                # a run during which the machine's other users took a share of
                                # the cores is measured again (up to --busy-retries times)
                                rep = measure(bed, front, prompts[:count], args.max_new)
                                if rep["outside_cpu_s"] / rep["wall"] <= args.busy_cores + 0.01 * count:
                                    break
                                if attempt < args.busy_retries:
                                    discarded[key] = discarded.get(key, 0) + 1
                            points.setdefault(key, []).append(rep)
            for ahead in (True, False):
                for (_, rtt, count), reps in [(k, v) for k, v in points.items() if k[0] == ahead]:
                    run = summarize(reps, reference)
                    run.update(rtt_ms=rtt, delay_ms=delays[rtt], ahead=ahead, sessions=count, protocol=args.protocol,
                               loss=args.loss, discarded_busy=discarded.get((ahead, rtt, count), 0))
                    record["runs"].append(run)
                    print(f"RTT {rtt:>4g} ms, {'ahead' if ahead else 'not ahead':>9}, {count:2d} sessions: "
                          f"{run['tokens_per_s']:7.1f} tokens/s, ITL {run['itl_ms'] or 0:6.1f} ms, "
                          f"TTFT {run['ttft_ms']:6.1f} ms, {len(run['rounds'])} rounds "
                          f"({run['lookahead_used']:.0%} used a look-ahead), exact {run['exact']}, "
                          f"CPU outside the deployment {run['outside_cpu_per_s']:.2f} cores"
                          + (f" ({run['discarded_busy']} busy runs measured again)" if run["discarded_busy"] else ""),
                          flush=True)
            record["etcd_appends_per_s"] = etcd_append_rate(bed.commit_log)
            print(f"etcd cluster (3 members): {record['etcd_appends_per_s']:.0f} appends/s "
                  "(16 logs at once, from the client link)", flush=True)
            if not args.no_faults:
                set_delay(bed, delays[rtts[min(1, len(rtts) - 1)]])
                record["faults"] = faults(bed, front, prompts[:4], reference, args.max_new)
        record["hosts"] = n_hosts
    Path(args.out).write_text(json.dumps(record, separators=(",", ":")))

    def series(ahead: bool) -> str:
        return "/".join(f"{r['tokens_per_s']:.0f}" for rtt in rtts for r in record["runs"]
                        if r["rtt_ms"] == rtt and r["ahead"] == ahead and r["sessions"] == args.sessions)
    ok = sum(1 for f in record["faults"] if f["exact"])
    rtt_text = "/".join(f"{r:g}" for r in rtts)
    if args.protocol != "h2" or args.loss:
        rtt_text += f" ({args.protocol}, {100 * args.loss:g}% UDP loss)"
    print(f"hosts: {n_hosts} hosts, RTT {rtt_text} ms: {args.sessions}-session tokens/s {series(True)} (ahead) "
          f"vs {series(False)} (not ahead); faults {ok}/{len(record['faults'])} exact")
    return 0


def faults(bed: Testbed, front: str, prompts: list[list[int]], reference: dict, max_new: int) -> list[dict]:
    out = []

    def verifier_cut(streams: list[Stream]) -> dict:
        wait_tokens(streams, 8)
        bed.net.cut("verifier")
        t0 = time.perf_counter()
        time.sleep(1.5)
        bed.net.restore("verifier")
        before = sum(len(s.tokens) for s in streams)
        while sum(len(s.tokens) for s in streams) == before and not all(s.finish or s.error for s in streams):
            time.sleep(0.005)
        return {"recovery_s": time.perf_counter() - t0}

    def drafter_cut(streams: list[Stream]) -> dict:
        wait_tokens(streams, 8)
        live = [g for g in httpx.get(f"{front}/v1/generations", timeout=10).json()["generations"]
                if g.get("finish") is None and g.get("drafter")]
        victim = next(i for i in bed.cluster.instances.values() if i.uri == live[0]["drafter"])
        on_it = {g["id"] for g in live if g["drafter"] == victim.uri}
        bed.net.cut(victim.name)
        t0 = time.perf_counter()
        moved = [s for s in streams if s.gid in on_it]
        before = [len(s.tokens) for s in moved]

        def elsewhere() -> set[str]:     # generations drafted by another drafter now
            listed = httpx.get(f"{front}/v1/generations", timeout=10).json()["generations"]
            return {g["id"] for g in listed if g.get("drafter") not in (None, victim.uri)}
        # recovered: every stream it held moves again, drafted elsewhere (a round already at
        # the verifier when the cut came still commits: that is no recovery)
        while not all(s.finish or s.error or (len(s.tokens) > b and s.gid in moved_on)
                      for s, b, moved_on in [(s, b, elsewhere()) for s, b in zip(moved, before, strict=True)]):
            time.sleep(0.02)
        return {"recovery_s": time.perf_counter() - t0, "sessions_moved": len(moved), "cut": victim.name}

    def etcd_member_killed(streams: list[Stream]) -> dict:
        wait_tokens(streams, 8)
        leader = bed.etcd.leader()
        victim = next(h for h in reversed(bed.etcd.hosts) if h != leader)
        bed.etcd.kill(victim)
        t0 = time.perf_counter()
        while not all(s.finish or s.error for s in streams):
            time.sleep(0.01)
        bed.etcd.start_member(victim)
        return {"recovery_s": None, "killed": victim, "until_done_s": time.perf_counter() - t0}

    def etcd_leader_partitioned(streams: list[Stream]) -> dict:
        wait_tokens(streams, 8)
        leader = bed.etcd.leader()
        bed.net.cut(leader)
        t0 = time.perf_counter()
        time.sleep(3.0)
        bed.net.restore(leader)
        before = sum(len(s.tokens) for s in streams)
        while sum(len(s.tokens) for s in streams) == before and not all(s.finish or s.error for s in streams):
            time.sleep(0.005)
        return {"recovery_s": time.perf_counter() - t0, "partitioned": leader,
                "new_leader": bed.etcd.leader()}

    for name, fault in (("verifier host cut off 1.5 s and back", verifier_cut),
                        ("etcd member (not the leader) killed, restarted after", etcd_member_killed),
                        ("etcd leader partitioned from the other two 3 s and back", etcd_leader_partitioned),
                        ("drafter host cut off for good", drafter_cut)):
        info: dict = {}
        streams, wall = run_streams(front, prompts, max_new, during=lambda s, f=fault, i=info: i.update(f(s)))
        result = {"fault": name, "exact": exact(streams, reference), "wall_s": wall, **info,
                  "errors": [s.error for s in streams if s.error]}
        out.append(result)
        held = ("nothing held up" if result.get("recovery_s") is None else
                f"the streams it held up moving again after {result['recovery_s']:.2f} s")
        print(f"fault: {name}: exact {result['exact']}, {held}"
              + (f" ({result['sessions_moved']} sessions moved)" if "sessions_moved" in result else ""), flush=True)
    return out


def wait_tokens(streams: list[Stream], n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(len(s.tokens) >= n for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError("no stream reached its fault point")
        time.sleep(0.005)



if __name__ == "__main__":
    sys.exit(main())
