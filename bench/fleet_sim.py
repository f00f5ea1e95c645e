"""A fleet of verifiers and drafters as a discrete-event model (SimPy), calibrated from the
namespace runs of bench/bench_hosts.py (issue 36).

    .venv/bin/python bench/fleet_sim.py [--runs bench/hosts_runs.json] [--itl-target-ms 25]
        [--plot bench/fleet_sim.png]

The model, one verifier at a time:
- a session's round: its drafter drafts M tokens (M drawn from the measured proposals), the
  proposal travels RTT/2 plus a message cost, waits for the verifier's next pass, the verdict
  travels back the same way; tokens 1..M are accepted position by position with the measured
  acceptance per position, and the verdict emits accepted + 1 tokens;
- the verifier batches every proposal waiting when a pass starts (after its 1 ms batching
  wait): a pass over n new tokens (M + 1 for each proposal) costs v0 + v1 * n;
- a drafter drafts its sessions' tokens in batched steps (one token for every session that
  wants one): a step for b sessions costs d0 + d1 * b;
- drafting ahead: while a proposal is out, the drafter drafts the next one on the
  all-accepted verdict when the session's acceptance makes that likely (alpha^M >= 0.5, as
  the drafter does); a verdict that accepts all M uses it, any other throws it away (its
  steps were spent anyway);
- co-located: drafting and verifying take turns on one device (one resource); split: the
  verifier's device verifies only, drafters have their own;
- a session starts when the router has placed it, one session at a time: the verifier opens
  it (open_cost of its device: prefill, first commit) and the assignment crosses to the
  drafter (one RTT), then `start` until its first round.

Calibration (printed): M's distribution and the acceptance per position from the drafters'
rounds logs; d0, d1 from the measured draft times at 1 and 16 sessions; v0, v1 and the message
cost fitted so the model reproduces the RTT 0.1 ms runs (1 and 16 sessions, not drafting
ahead). Validation: every other measured run (RTT 2, 10, 30 ms; ahead and not) simulated and
compared, tokens/s and inter-token latency, error in percent (goal: within 15%).

Then, from the model: sessions one verifier sustains at the ITL target, split vs co-located,
next to the bound 1 + gamma * t_d / t_v from the same calibration (gamma: tokens drafted per
round, t_d: drafting cost per token, t_v: the verifier's pass per round); drafters needed per
verifier; capacity against RTT with and without drafting ahead; and fleets of 1 to 10,000
verifiers: the commit log appends and the router's relayed tokens they generate against the
measured capacity of one etcd cluster and one router core (bench_hosts measures appends/s
and every process's CPU seconds per token), i.e. where each saturates.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast.core.control import choose_m  # noqa: E402

try:
    import simpy
except ImportError:                 # pragma: no cover - an install without the sim extra
    print("fleet_sim needs SimPy: pip install -e '.[sim]'", file=sys.stderr)
    raise SystemExit(2) from None

BATCH_WAIT_S = 0.001                # the verifier's max_wait_ms in the deployment (demo plan)
LOOKAHEAD_MIN_P = 0.5               # sdcp_fast/drafter/session.py's threshold
STEADY = 8                          # capacity runs: generations this many times the measured ones


@dataclass
class Params:
    m_values: list[int]             # M of measured proposals (their largest is the limit)
    alpha: list[float]              # acceptance at position 1..m_max
    alpha_mean: float               # one per-token acceptance, as the drafter's EWMA sees it
    d0: float                       # drafting step: d0 + d1 * sessions in the step (s)
    d1: float
    v0: float                       # verifier pass: v0 + v1 * tokens in the pass (M + 1 a proposal) (s)
    v1: float
    msg: float                      # one message's cost besides the wire (s), each way
    start: float                    # a session's opening until its first round (s)
    open_cost: float                # the verifier's device per session opened (prefill), serial (s)
    rtt: float                      # s
    ahead: bool
    colocated: bool = False
    drafters: int = 2

    @property
    def mean_m(self) -> float:
        return statistics.fmean(self.m_values)

    def full_accept_p(self, m: int) -> float:
        return math.prod(self.alpha[:m])


@dataclass
class Result:
    tokens_per_s: float
    itl_ms: float


# ---------------------------------------------------------------------- the model


class Model:
    def __init__(self, p: Params, sessions: int, max_new: int, seed: int):
        self.p, self.sessions, self.max_new = p, sessions, max_new
        self.env = simpy.Environment()
        self.rng = random.Random(seed)
        self.device = simpy.Resource(self.env, 1)              # the verifier's
        self.placing = simpy.Resource(self.env, 1)             # the router places one session at a time
        self.draft_devices = [self.device if p.colocated else simpy.Resource(self.env, 1)
                              for _ in range(max(1, p.drafters))]
        self.pending: list[tuple[int, simpy.Event]] = []
        self.wake = self.env.event()
        self.want: list[list[tuple[int, simpy.Event]]] = [[] for _ in self.draft_devices]
        self.draft_wake = [self.env.event() for _ in self.draft_devices]
        self.emitted = [0] * sessions
        self.itl: list[float] = []          # per session, as bench_hosts measures it
        self.finished = 0
        self.end_time = 0.0

    def run(self) -> Result:
        self.env.process(self.verifier())
        for j in range(len(self.draft_devices)):
            self.env.process(self.drafter(j))
        for s in range(self.sessions):
            self.env.process(self.session(s))
        self.env.run()
        total = sum(self.emitted)
        return Result(total / self.end_time, 1000 * statistics.median(self.itl))

    def draft(self, j: int, tokens: int) -> list:
        """[tokens left, event]: the event fires once drafter j drafted them for one session."""
        item = [tokens, self.env.event()]
        self.want[j].append(item)
        if not self.draft_wake[j].triggered:
            self.draft_wake[j].succeed()
        return item

    def cancel(self, j: int, item: list) -> None:
        if item in self.want[j]:
            self.want[j].remove(item)

    def drafter(self, j: int):
        p = self.p
        while True:
            if not self.want[j]:
                self.draft_wake[j] = self.env.event()
                yield self.draft_wake[j]
            with self.draft_devices[j].request() as turn:
                yield turn
                # co-located: the device drafts every wanted token before a pass may run
                # (a split drafter's device is its own, so the same loop)
                while self.want[j]:
                    batch = list(self.want[j])
                    yield self.env.timeout(p.d0 + p.d1 * len(batch))
                    for item in batch:
                        if item not in self.want[j]:
                            continue                 # cancelled during the step
                        item[0] -= 1
                        if item[0] <= 0:
                            self.want[j].remove(item)
                            item[1].succeed()

    def verifier(self):
        p = self.p
        while self.finished < self.sessions:
            if not self.pending:
                self.wake = self.env.event()
                yield self.wake | self.env.timeout(1.0)
                continue
            yield self.env.timeout(BATCH_WAIT_S)
            batch, self.pending = self.pending, []
            with self.device.request() as turn:
                yield turn
                yield self.env.timeout(p.v0 + p.v1 * sum(m + 1 for m, _ in batch))
            for m, answered in batch:
                answered.succeed(self.accepted(m))

    def accepted(self, m: int) -> int:
        for k in range(m):
            if self.rng.random() >= self.p.alpha[min(k, len(self.p.alpha) - 1)]:
                return k
        return m

    def session(self, s: int):
        p, env = self.p, self.env
        j = s % len(self.draft_devices)
        yield env.timeout(self.rng.uniform(0, 0.002))
        with self.placing.request() as placing:       # the router places it: the verifier opens it
            yield placing                              # (prefill, first commit), then the drafter's
            with self.device.request() as turn:        # assignment crosses the wire
                yield turn
                yield env.timeout(p.open_cost)
            yield env.timeout(p.rtt)
        yield env.timeout(p.start)
        ready_ahead = None
        first = first_tokens = last = None
        m_limit = max(p.m_values)
        t_draft = p.d0 + p.d1                          # per token, then as measured (EWMA 0.2)
        t_verify = p.rtt + 2 * p.msg + p.v0 + 2 * p.v1  # the turnaround, likewise
        while self.emitted[s] < self.max_new:
            # M as the drafter chooses it (core.control.choose_m, section 6.2)
            m = min(choose_m(p.alpha_mean, t_draft, t_verify, m_limit), self.max_new - self.emitted[s])
            began = env.now
            if ready_ahead is None:
                yield self.draft(j, m)[1]
            elif not ready_ahead[1].triggered:
                yield ready_ahead[1]                   # what drafting ahead has not finished yet
            if ready_ahead is None:
                t_draft += 0.2 * ((env.now - began) / m - t_draft)
            ahead = None
            if p.ahead and p.full_accept_p(m) >= LOOKAHEAD_MIN_P:
                ahead = self.draft(j, min(m_limit, m + 1))
            sent = env.now
            yield env.timeout(p.rtt / 2 + p.msg)
            answered = env.event()
            self.pending.append((m, answered))
            if not self.wake.triggered:
                self.wake.succeed()
            a = yield answered
            yield env.timeout(p.rtt / 2 + p.msg)
            t_verify += 0.2 * ((env.now - sent) - t_verify)
            emitted = min(a + 1, self.max_new - self.emitted[s])
            if first is None:
                first, first_tokens = env.now, emitted
            last = env.now
            self.emitted[s] += emitted
            if ahead is not None and a != m:
                self.cancel(j, ahead)                  # the verdict invalidated it
                ahead = None
            ready_ahead = ahead
        if last is not None and self.emitted[s] > 1 and last > first:
            self.itl.append((last - first) / (self.emitted[s] - 1))
        elif first_tokens:
            self.itl.append(0.0)
        self.finished += 1
        self.end_time = max(self.end_time, env.now)
        if not self.wake.triggered:
            self.wake.succeed()


def simulate(p: Params, sessions: int, max_new: int, seeds: int = 3) -> Result:
    results = [Model(p, sessions, max_new, seed).run() for seed in range(seeds)]
    return Result(statistics.fmean(r.tokens_per_s for r in results), statistics.fmean(r.itl_ms for r in results))


# ---------------------------------------------------------------------- calibration


def acceptance(rounds: list[dict]) -> list[float]:
    """P(position k accepted | positions < k accepted), k = 1..max M."""
    top = max(r["m"] for r in rounds)
    out = []
    for k in range(1, top + 1):
        tried = sum(1 for r in rounds if r["m"] >= k and r["accepted"] >= k - 1)
        took = sum(1 for r in rounds if r["accepted"] >= k)
        out.append(took / tried if tried else (out[-1] if out else 0.5))
    return out


def calibrate(record: dict) -> tuple[Params, dict]:
    runs = record["runs"]
    low = min(r["rtt_ms"] for r in runs)
    base = [r for r in runs if r["rtt_ms"] == low]
    rounds = [x for r in runs for x in r["rounds"]]
    m_values = [x["m"] for x in rounds]
    alpha = acceptance(rounds)
    # the drafter's per-token acceptance: accepted over proposed
    alpha_mean = sum(x["accepted"] for x in rounds) / max(1, sum(x["m"] for x in rounds))
    # drafting steps: draft_ms / M at one session and at the most sessions (per drafter)
    def per_token(rs):
        return statistics.median(x["draft_ms"] / 1000 / x["m"] for x in rs if x["m"] and not x["ahead"])
    one = next(r for r in base if r["sessions"] == 1 and not r["ahead"])
    many = max((r for r in base if not r["ahead"]), key=lambda r: r["sessions"])
    per_drafter = many["sessions"] / 2
    t1, tn = per_token(one["rounds"]), per_token(many["rounds"])
    d1 = max(0.0, (tn - t1) / max(per_drafter - 1, 1))
    d0 = max(1e-5, t1 - d1)
    # a session's start: the 1-session run's wall time less its streaming time
    reps = one.get("repeats", 1)
    start = max(0.0, one["wall_s"] / reps - one["itl_ms"] / 1000 * (one["tokens"] / reps - 1))
    p = Params(m_values, alpha, alpha_mean, d0, d1, v0=0.002, v1=0.0005, msg=0.001, start=start, open_cost=0.005,
               rtt=low / 1000, ahead=False)
    # fit v0, v1, msg to the base runs (tokens/s and ITL), coarse grid then a finer one
    targets = [(r["sessions"], r["ahead"], r["tokens_per_s"], r["itl_ms"]) for r in base]
    max_new = record["max_new"]

    def loss(q: Params, seeds: int = 1) -> float:
        err = 0.0
        for sessions, ahead, tps, itl in targets:
            sim = simulate(replace(q, ahead=ahead), sessions, max_new, seeds=seeds)
            err += (sim.tokens_per_s / tps - 1) ** 2 + (sim.itl_ms / itl - 1) ** 2
        return err

    best = (math.inf, p)
    for v0 in (0.0005, 0.002, 0.006, 0.016):
        for v1 in (0.0001, 0.0004, 0.001, 0.0025):
            for msg in (0.0002, 0.0008, 0.002, 0.005):
                for open_cost in (0.003, 0.01, 0.03, 0.08):
                    q = replace(p, v0=v0, v1=v1, msg=msg, open_cost=open_cost, start=max(0.0, start - open_cost))
                    best = min(best, (loss(q), q), key=lambda t: t[0])
    p = best[1]
    best = (loss(p, 3), p)
    for _ in range(3):
        for name in ("v0", "v1", "msg", "open_cost"):
            for f in (0.5, 0.7, 0.85, 1.2, 1.4, 2.0):
                q = replace(p, **{name: getattr(p, name) * f})
                q = replace(q, start=max(0.0, start - q.open_cost))
                best = min(best, (loss(q, 3), q), key=lambda t: t[0])
            p = best[1]
    return p, {"base_runs": len(base), "fit_loss": best[0]}


# ---------------------------------------------------------------------- questions


def validate(p: Params, record: dict) -> list[dict]:
    out = []
    for r in record["runs"]:
        q = replace(p, rtt=r["rtt_ms"] / 1000, ahead=r["ahead"])
        sim = simulate(q, r["sessions"], record["max_new"])
        out.append({"rtt_ms": r["rtt_ms"], "ahead": r["ahead"], "sessions": r["sessions"],
                    "tps": (r["tokens_per_s"], sim.tokens_per_s), "itl": (r["itl_ms"], sim.itl_ms),
                    "tps_err": 100 * (sim.tokens_per_s / r["tokens_per_s"] - 1),
                    "itl_err": 100 * (sim.itl_ms / r["itl_ms"] - 1)})
    return out


def capacity(p: Params, itl_target_ms: float, max_new: int, limit: int = 512) -> int:
    """The most sessions whose median inter-token latency stays within the target, in steady
    state: generations of STEADY x max_new tokens, so that the staggered starts weigh little."""
    max_new *= STEADY
    lo, hi = 0, 1
    while hi <= limit and simulate(p, hi, max_new, seeds=1).itl_ms <= itl_target_ms:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if simulate(p, mid, max_new, seeds=1).itl_ms <= itl_target_ms:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(Path(__file__).with_name("hosts_runs.json")))
    parser.add_argument("--itl-target-ms", type=float, default=25.0)
    parser.add_argument("--plot", default=None, help="write capacity against RTT and fleet size (PNG)")
    args = parser.parse_args()
    record = json.loads(Path(args.runs).read_text())
    fields = record.get("round_fields")
    if fields:                       # rounds stored as rows
        for run in record["runs"]:
            run["rounds"] = [dict(zip(fields, row, strict=True)) for row in run["rounds"]]
    max_new = record["max_new"]

    p, fit = calibrate(record)
    print(f"calibrated from {args.runs} ({record['machine']}): measured M mean {p.mean_m:.2f} "
          f"(values {dict(sorted(Counter(p.m_values).items()))}), acceptance by position "
          f"{' '.join(f'{a:.2f}' for a in p.alpha)}")
    print(f"  drafting step {1e3 * p.d0:.3f} + {1e3 * p.d1:.3f} x sessions ms; verifier pass {1e3 * p.v0:.3f} + "
          f"{1e3 * p.v1:.3f} x tokens ms; message cost {1e3 * p.msg:.3f} ms each way; session open "
          f"{1e3 * p.open_cost:.1f} ms of the verifier, then {1e3 * p.start:.0f} ms to its first round "
          f"(fitted to the {fit['base_runs']} runs at the lowest RTT); the drafter's acceptance {p.alpha_mean:.2f}, M its "
          "choice (core.control.choose_m) from the turnaround and drafting cost the session sees")

    print("\nvalidation against the namespace runs (measured -> simulated):")
    print("| RTT ms | ahead | sessions | tokens/s | error | ITL ms | error |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    checks = validate(p, record)
    for c in checks:
        print(f"| {c['rtt_ms']:g} | {'yes' if c['ahead'] else 'no'} | {c['sessions']} | {c['tps'][0]:.0f} -> "
              f"{c['tps'][1]:.0f} | {c['tps_err']:+.1f}% | {c['itl'][0]:.1f} -> {c['itl'][1]:.1f} | "
              f"{c['itl_err']:+.1f}% |")
    worst_tps = max(abs(c["tps_err"]) for c in checks)
    worst_itl = max(abs(c["itl_err"]) for c in checks)
    within = sum(1 for c in checks if abs(c["tps_err"]) <= 15 and abs(c["itl_err"]) <= 15)
    print(f"validation: {within}/{len(checks)} runs within 15% on both; worst tokens/s error {worst_tps:.1f}%, "
          f"worst ITL error {worst_itl:.1f}%")

    # one verifier: split vs co-located at the lowest RTT, drafters plenty
    low = min(r["rtt_ms"] for r in record["runs"]) / 1000
    target = args.itl_target_ms
    split = capacity(replace(p, rtt=low, drafters=8), target, max_new)
    colocated = capacity(replace(p, rtt=0.0, msg=0.0, colocated=True, drafters=1), target, max_new)
    gamma = p.mean_m
    t_d, t_v = p.d0 + p.d1, p.v0 + p.v1 * (gamma + 1)   # one session alone: a token drafted, a pass
    bound = 1 + gamma * t_d / t_v
    marginal = 1 + gamma * p.d1 / (p.v1 * (gamma + 1))  # one more session in a batch: its share of each
    print(f"\none verifier at ITL <= {target:g} ms: {split} sessions split (8 drafters, RTT {1e3 * low:g} ms) vs "
          f"{colocated} co-located: {split / max(colocated, 1):.2f}x; bound 1 + gamma * t_d / t_v = 1 + "
          f"{gamma:.2f} x {1e3 * t_d:.3f} / {1e3 * t_v:.3f} = {bound:.2f} (one session alone), "
          f"1 + {gamma:.2f} x {1e3 * p.d1:.3f} / {1e3 * p.v1 * (gamma + 1):.3f} = {marginal:.2f} (a session's share "
          "of batched work)")
    needed = None
    for d in range(1, 9):
        if capacity(replace(p, rtt=low, drafters=d), target, max_new) >= 0.95 * split:
            needed = d
            break
    print(f"drafters per verifier for 95% of that capacity: {needed}")

    print("\ncapacity against RTT (sessions at the ITL target, split, 8 drafters):")
    rtts = [0.1, 2, 10, 30, 50, 100, 200]
    by_rtt = {}
    for ahead in (True, False):
        by_rtt[ahead] = [capacity(replace(p, rtt=r / 1000, drafters=8, ahead=ahead), target, max_new) for r in rtts]
    print("| RTT ms | " + " | ".join(f"{r:g}" for r in rtts) + " |")
    print("|---|" + "---:|" * len(rtts))
    for ahead in (True, False):
        print(f"| {'ahead' if ahead else 'not ahead'} | " + " | ".join(map(str, by_rtt[ahead])) + " |")

    fleet(record, p, split, max_new, target, args.plot, rtts, by_rtt, colocated)
    return 0


def fleet(record: dict, p: Params, per_verifier: int, max_new: int, target: float, plot: str | None,
          rtts: list[float], by_rtt: dict, colocated: int) -> None:
    """Fleets of 1..10,000 verifiers at their capacity: commit-log appends (one per session
    round) and relayed tokens, against one etcd cluster's measured appends/s and one router
    core's measured CPU per token."""
    sim = simulate(replace(p, rtt=min(r["rtt_ms"] for r in record["runs"]) / 1000, drafters=8),
                   max(1, per_verifier), max_new * STEADY)
    tokens_per_verifier = sim.tokens_per_s
    rounds_per_token = 1 / statistics.fmean(x["emitted"] for r in record["runs"] for x in r["rounds"])
    appends_per_verifier = tokens_per_verifier * rounds_per_token
    big = [r for r in record["runs"] if r["sessions"] > 1]
    router_cpu = sum(r["cpu_s"].get("router", 0) for r in big) / sum(r["tokens"] for r in big)
    etcd_cpu = sum(sum(v for k, v in r["cpu_s"].items() if k.startswith("etcd")) for r in big) / sum(
        r["tokens"] * rounds_per_token for r in big)
    etcd_capacity = record.get("etcd_appends_per_s") or 1.0
    router_capacity = 1 / router_cpu if router_cpu else math.inf
    print(f"\nfleet: one verifier at capacity makes {tokens_per_verifier:.0f} tokens/s and "
          f"{appends_per_verifier:.0f} commit appends/s; measured: etcd cluster {etcd_capacity:.0f} appends/s "
          f"(its members' CPU {1e3 * etcd_cpu:.2f} ms per append), router {1e3 * router_cpu:.3f} ms CPU per token "
          f"({router_capacity:.0f} tokens/s per core)")
    print("| verifiers | sessions | tokens/s | appends/s | etcd clusters needed | router cores needed |")
    print("|---:|---:|---:|---:|---:|---:|")
    sizes = [1, 10, 100, 1000, 10000]
    for n in sizes:
        print(f"| {n} | {n * per_verifier} | {n * tokens_per_verifier:.0f} | {n * appends_per_verifier:.0f} | "
              f"{math.ceil(n * appends_per_verifier / etcd_capacity)} | "
              f"{math.ceil(n * tokens_per_verifier / router_capacity)} |")
    one_etcd = etcd_capacity / appends_per_verifier
    one_router = router_capacity / tokens_per_verifier
    print(f"one etcd cluster saturates at {one_etcd:.1f} verifiers, one router core at {one_router:.1f} verifiers")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for ahead in (True, False):
            a.plot(rtts, by_rtt[ahead], marker="o", label="drafting ahead" if ahead else "not ahead")
        a.axhline(colocated, linestyle="--", color="grey", label="co-located (no RTT)")
        a.set_ylim(0, max(max(by_rtt[True]), max(by_rtt[False]), colocated) + 4)
        a.set_xlabel("RTT drafter-verifier (ms)")
        a.set_ylabel(f"sessions per verifier at ITL <= {target:g} ms")
        a.set_title("one verifier (model)")
        a.legend()
        tokens = [n * tokens_per_verifier for n in sizes]
        one = [min(t, etcd_capacity / rounds_per_token, router_capacity) for t in tokens]
        b.loglog(sizes, tokens, marker="o", label="etcd clusters and routers scaled")
        b.loglog(sizes, one, marker="s", label="one etcd cluster, one router core")
        b.set_xlabel("verifiers")
        b.set_ylabel("fleet tokens/s")
        b.set_title("fleet capacity (model)")
        b.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")



if __name__ == "__main__":
    sys.exit(main())
