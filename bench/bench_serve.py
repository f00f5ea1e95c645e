"""Serving measured the way users do (issue 38): a deployment of processes behind the OpenAI
door, driven at 1, 2, 4, ... 64 concurrent streamed chat requests, against the target alone.

    .venv/bin/python bench/bench_serve.py [--levels 1,2,4,8,16,32,64] [--max-tokens 64]
        [--temperatures 0,0.7] [--modes sdcp,off] [--drafters 2] [--draft SPEC] [--repeat 1]
        [--json FILE] [--plot FILE.png] [--workdir DIR] [--quick] [--no-settle] [--no-draft-ahead]
        [--warmup-waves N] [--verifier-option MEMBER=VALUE ...] [--m-max M] [--rounds-log]

1. The target `hf:smollm2` loads in this process (the first run converts the GGUF into
   $SDCP_CACHE). 64 held-out chat prompts (not the demo's; each asks for a long answer),
   rendered with the tokenizer's chat template; the stop is `<|im_end|>` or --max-tokens.
2. The reference (greedy only): `generate()` one prompt at a time (hf_baseline.generate_each),
   the outputs every greedy SDCP answer must equal (its text, without the stop token).
3. The baseline a user has: transformers `generate()`, the target alone on the whole machine
   (torch's default threads), the c prompts of level c in one left-padded batch; greedy, or
   sampling with temperature T (top_k 0, top_p 1: the plain tempered distribution). A
   streamer timestamps every step: time to first token and inter-token latency per row.
4. The deployment (`sdcp_fast.procs.Cluster` + `demo.deployment.plan`): router with the
   OpenAI front door, verifier `hf:smollm2`, --drafters drafters of `real_pair.choose_draft()`
   (or --draft). Modes: `sdcp` (the verifier's speculation policy `auto`, the default
   deployment), `off` (the same deployment, the verifier decoding every session itself:
   `speculation = "off"`), `on` (always speculate). One deployment per mode, all started
   before the first level (each idle while another way runs), then warmed up: one short request,
   and where drafters run, one-request waves (greedy, untimed, at most 24) until each drafter
   that drafted has chosen whether drafting ahead pays on this host (drafter/ahead.py measures
   both ways over its first blocks of rounds; `--no-settle` measures from the first rounds),
   and before each level's measured waves one untimed wave of that level on each deployment
   (`--warmup-waves N`; the verifier measures its way at each load it meets over its first
   blocks of rounds there, bench/RESULTS.md, issue 38, tenth session), so the levels measure
   steady-state serving, as a deployment that has met these loads before serves them. Nothing
   else should run on the
   machine (the load average is printed). A level's waves alternate between the ways, wave
   by wave (the target alone, then each mode), so that the drift of a shared machine's speed
   weighs on every way of the level alike instead of on whichever ran in a slow minute.
   Level c sends the first c prompts at once (one wave; --repeat waves), each a streamed
   `chat.completions` request (max_tokens, temperature, stream_options.include_usage).
   The driver is the official `openai` client (AsyncOpenAI, one event loop, an httpx client
   with at least c connections), not a load tool such as GuideLLM or AIPerf: on a 2-core
   machine the load generator shares the CPU with the deployment and the baseline, and one
   asyncio process costs the least while measuring exactly what a user of the API sees.
5. Per level and way: output tokens/s (completion tokens, from usage, over the wall time from
   the first request sent to the last stream finished), TTFT p50/p99 (request sent -> first
   text), ITL p50/p99 (per request: (last token's chunk - first text) / (tokens - 1)); for the
   deployment also the verifier's /metrics deltas: draft tokens, accepted, tokens the
   verifier decoded itself (their share of the output), forward passes, mean batch, forward,
   verify-kernel, commit-log-append and queue seconds beside the level's wall time, and the
   cores each process used over the level (verifier, router, each drafter, the driver) and
   those left idle (the per-phase view of a level).

Outputs: a table per temperature, --json with everything, --plot (tokens/s and ITL p50
against concurrency, one line per way). Last line (greedy; a T=0.7 line before it):
`serve: c=1 A.AAx c=2 B.BBx ... c=64 G.GGx vs the target alone on the whole machine (min
M.MMx), identical yes|no` (SDCP tokens/s over the baseline's at each level; identical when
every greedy answer of every mode equals the reference). Exit code 0 only when every request
finished and the greedy answers are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from sdcp_fast.demo import deployment
from sdcp_fast.demo.client import wait_live
from sdcp_fast.demo.hf_baseline import (
    chat_prompts,
    end_of_turn,
    generate_batched,
    generate_each,
)
from sdcp_fast.demo.real_pair import TARGET, choose_draft, progress

TOPICS = [
    "a refrigerator", "the internet", "a car engine", "photosynthesis", "a vaccine", "a credit card payment",
    "a nuclear power plant", "the human heart", "an airplane wing", "a compiler", "a solar panel",
    "a hard disk drive", "the stock market", "a microwave oven", "GPS navigation", "a search engine",
    "the immune system", "a rocket launch", "a lithium-ion battery", "public key cryptography",
    "a wind turbine", "the water cycle", "an electric motor", "a telescope", "a bank loan",
    "a 3D printer", "the human eye", "a thermostat", "a blockchain", "an elevator", "a camera lens",
    "a dishwasher", "the postal system", "a hydroelectric dam", "a touch screen", "a jet engine",
    "the digestive system", "a washing machine", "an operating system", "a submarine", "a heat pump",
    "a traffic light network", "a mobile phone network", "the kidney", "an espresso machine",
    "a database index", "a hurricane", "a bicycle gearbox", "a library catalogue", "an earthquake",
    "a printing press", "a voting system", "a sewage treatment plant", "a piano", "a recycling plant",
    "a weather forecast", "a lock and key", "an insurance policy", "a volcano", "a satellite",
    "a supermarket supply chain", "a neural network", "a fire extinguisher", "a coffee roaster",
]
TEXTS = [f"Explain in detail how {topic} works, step by step." for topic in TOPICS]
MODES = {"sdcp": "auto", "off": "off", "on": "on"}   # mode -> the verifier's `speculation`
DRIVER = "the official openai client (AsyncOpenAI, one asyncio process)"
VERIFIER_SERIES = ("sdcp_spec_decode_num_draft_tokens_total", "sdcp_spec_decode_num_accepted_tokens_total",
                   "sdcp_self_decoded_tokens_total", "sdcp_forward_seconds_sum", "sdcp_forward_seconds_count",
                   "sdcp_batch_size_sum", "sdcp_queue_wait_seconds_sum", "sdcp_kernel_seconds_sum",
                   "sdcp_commit_log_append_seconds_sum", "process_cpu_seconds_total")


@dataclass
class Answer:
    """One request (or one row of a batch): its text/tokens and its times (perf_counter)."""

    tokens: int
    sent: float
    first: float | None
    last: float | None
    text: str = ""
    finish: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def itl(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


@dataclass
class Level:
    way: str           # baseline | sdcp | off | on
    temperature: float
    concurrency: int
    answers: list[Answer] = field(default_factory=list)
    wall: float = 0.0  # summed over the waves
    verifier: dict[str, float] = field(default_factory=dict)   # /metrics deltas
    cpu: float = 0.0   # CPU seconds of the target's process (the baseline's own; the verifier's)
    roles_cpu: dict[str, float] = field(default_factory=dict)   # CPU seconds per process of the level

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.answers)

    def add(self, wave: Level) -> None:
        """Another wave of the same way and level (drive's or the baseline's)."""
        self.answers += wave.answers
        self.wall += wave.wall
        self.cpu += wave.cpu
        for into, part in ((self.roles_cpu, wave.roles_cpu), (self.verifier, wave.verifier)):
            for name, value in part.items():
                into[name] = into.get(name, 0.0) + value

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    @property
    def per_cpu_second(self) -> float:
        """Tokens per CPU second of the process that runs the target (the split-drafting view:
        a verifier host whose drafters run elsewhere spends only the verifier's CPU)."""
        cpu = self.cpu or self.verifier.get("process_cpu_seconds_total", 0.0)
        return self.tokens / cpu if cpu else 0.0

    def pct(self, what: str, q: float) -> float:
        values = [v for v in (getattr(a, what) for a in self.answers) if v is not None]
        return float(np.percentile(values, q)) if values else float("nan")

    def summary(self) -> dict:
        out = {"way": self.way, "temperature": self.temperature, "concurrency": self.concurrency,
               "tokens": self.tokens, "wall_s": self.wall, "tokens_per_s": self.rate,
               **{f"{w}_p{q}_s": self.pct(w, q) for w in ("ttft", "itl") for q in (50, 99)},
               "target_cpu_s": self.cpu or self.verifier.get("process_cpu_seconds_total", 0.0),
               "tokens_per_target_cpu_s": self.per_cpu_second, "verifier": self.verifier,
               "roles_cpu_s": self.roles_cpu}
        if self.verifier and self.tokens:
            out["self_decoded_share"] = self.verifier.get("sdcp_self_decoded_tokens_total", 0.0) / self.tokens
        return out


# ---------------------------------------------------------------------- the target alone


class StepTimes(BaseStreamer):
    """generate()'s streamer: put() gets the prompt once, then every step's tokens (the whole
    batch); the time of each step."""

    def __init__(self):
        self.steps: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.steps.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


@torch.no_grad()
def alone_batch(model, prompts: list[list[int]], max_new: int, eos: int, temperature: float) -> list[Answer]:
    """generate() with the target alone, the prompts in one left-padded batch
    (hf_baseline.generate_batched), with a streamer timing its steps: one Answer per row."""
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    streamer = StepTimes()
    decoded = generate_batched(model, prompts, max_new, eos, streamer=streamer, **sampling)
    steps = streamer.steps
    return [Answer(len(tokens), decoded.started, steps[0] if steps else None,
                   steps[min(len(tokens), len(steps)) - 1] if steps else None)
            for tokens in decoded.outputs]


# ---------------------------------------------------------------------- the deployment


def start_deployment(root: Path, mode: str, draft_spec: str, draft_digest: str, max_new: int, eos: int,
                     drafters: int, batch_log: str | None = None, draft_ahead: bool = True,
                     verifier_options: dict | None = None, m_max: int = 8, rounds_log: bool = False):
    """Router (OpenAI door), verifier (metrics port) and drafters as processes; (cluster,
    front door URL, verifier metrics URL)."""
    from sdcp_fast.procs import Cluster

    cluster = Cluster(root / mode, protocol="h2")
    deployment.plan(cluster, TARGET, draft_spec, draft_digest, max_new, (eos,), slow=True, drafters=drafters,
                    rounds_log=rounds_log, metrics=True, m_max=m_max)
    verifier = cluster.instances["verifier"]
    if mode != "sdcp":   # the default deployment leaves the verifier's policy as configured (auto)
        verifier.config = dataclasses.replace(
            verifier.config, verifier=dataclasses.replace(verifier.config.verifier, speculation=MODES[mode]))
    if not draft_ahead:   # the drafters wait for each verdict (an A/B knob)
        for name, instance in cluster.instances.items():
            if name.startswith("drafter"):
                instance.config = dataclasses.replace(
                    instance.config, drafter=dataclasses.replace(instance.config.drafter, draft_ahead=False))
    if verifier_options:   # [verifier] members set for an A/B run (--verifier-option)
        section = verifier.config.verifier
        typed = {k: v.lower() in ("1", "true", "yes") if isinstance(getattr(section, k), bool)
                 else type(getattr(section, k))(v) for k, v in verifier_options.items()}
        verifier.config = dataclasses.replace(verifier.config, verifier=dataclasses.replace(section, **typed))
    if batch_log:   # one JSON line per verify batch: the verifier's timeline
        verifier.config = dataclasses.replace(
            verifier.config, verifier=dataclasses.replace(verifier.config.verifier,
                                                          batch_log=str(Path(batch_log).resolve())))
    try:
        with progress(f"starting the deployment ({mode}): router, verifier and {drafters} drafter(s)"):
            cluster.start(timeout=600)
            front = cluster.instances["router"].frontdoor_url
            wait_live(front, 1 + drafters, timeout=180)
    except BaseException:
        cluster.stop()
        raise
    return cluster, front, f"http://{verifier.config.verifier.metrics}/metrics"


def settle_drafting_ahead(cluster, front: str, metrics_url: str, max_tokens: int, mode: str,
                          max_waves: int = 24) -> str:
    """One-request waves (greedy, untimed) until every drafter that has drafted has chosen
    whether drafting ahead pays (drafter/ahead.py measures both ways over its first blocks of
    rounds): the figures that follow are steady-state serving, not that warm-up. Returns what
    each drafter chose."""
    names = ("sdcp_drafter_draft_ahead", "sdcp_draft_seconds_count")
    urls = {name: f"http://{i.config.drafter.metrics}/metrics"
            for name, i in cluster.instances.items() if name.startswith("drafter")}
    waves = 0
    while True:
        seen = {name: scrape(url, names) for name, url in urls.items()}
        drafted = [v for v in seen.values() if v.get("sdcp_draft_seconds_count", 0) > 0]
        if waves == max_waves or (drafted and all(v.get("sdcp_drafter_draft_ahead", -1) >= 0 for v in drafted)):
            break
        asyncio.run(drive(front, [TEXTS[waves % len(TEXTS)]], max_tokens, 0.0, 1, metrics_url, f"{mode} settle"))
        waves += 1
    words = {-1: "still measuring", 0: "waits for each verdict", 1: "drafts ahead"}
    return f"after {waves} wave(s): " + ", ".join(
        f"{name} {words[int(v.get('sdcp_drafter_draft_ahead', -1))]}"
        + ("" if v.get("sdcp_draft_seconds_count", 0) else " (no rounds)") for name, v in seen.items())


def scrape(url: str, names: tuple[str, ...] = VERIFIER_SERIES) -> dict[str, float]:
    import httpx

    values = {}
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return values
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


async def one_request(client, model: str, text: str, max_tokens: int, temperature: float, seed: int) -> Answer:
    sent = time.perf_counter()
    answer = Answer(0, sent, None, None)
    parts = []
    options = {"seed": seed} if temperature > 0 else {}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            temperature=temperature, stream=True, stream_options={"include_usage": True}, **options)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                answer.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    parts.append(choice.delta.content)
                    answer.first = answer.first or now
                    answer.last = now
                if choice.finish_reason:   # the stop token ends the answer with no text of its own
                    answer.finish, answer.last = choice.finish_reason, now
    except Exception as exc:   # counted and shown; the level goes on
        answer.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    answer.text = "".join(parts)
    return answer


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each named process so far (Linux /proc; {} elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def drive(front: str, texts: list[str], max_tokens: int, temperature: float, waves: int,
                metrics_url: str, way: str, pids: dict[str, int] | None = None, *, first_wave: int = 0) -> Level:
    """`waves` waves of len(texts) streamed chat completions at once (wave numbers from
    `first_wave`: the requests' seeds); `pids` (role -> process) have their CPU seconds over
    the waves kept, beside the driver's own."""
    import httpx
    from openai import AsyncOpenAI

    c = len(texts)
    level = Level(way, temperature, c)
    limits = httpx.Limits(max_connections=max(c, 8), max_keepalive_connections=max(c, 8))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0, connect=30.0)) as http:
        client = AsyncOpenAI(base_url=f"{front}/v1", api_key="none", http_client=http, max_retries=0)
        model = (await client.models.list()).data[0].id
        before = scrape(metrics_url)
        pids = {**(pids or {}), "driver": os.getpid()}
        cpu_before = cpu_seconds(pids)
        for wave in range(first_wave, first_wave + waves):
            started = time.perf_counter()
            level.answers += await asyncio.gather(*(
                one_request(client, model, text, max_tokens, temperature, seed=1000 * wave + n)
                for n, text in enumerate(texts)))
            level.wall += time.perf_counter() - started
        cpu_after = cpu_seconds(pids)
        level.roles_cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after if name in cpu_before}
        after = scrape(metrics_url)
    level.verifier = {k: after[k] - before.get(k, 0.0) for k in after}
    return level


# ---------------------------------------------------------------------- reporting


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{1000 * seconds:.0f}"


def table(results: dict, temperature: float, levels: list[int], ways: list[str]) -> None:
    head = f"{'c':>3} {'alone tok/s':>11}"
    for way in ways[1:]:
        head += f" {way + ' tok/s':>11} {'ratio':>6}"
    for way in ways:
        head += f" {way[:5] + ' TTFT p50/p99 ms':>21} {way[:5] + ' ITL p50/p99 ms':>20}"
    head += "  self-decoded"
    print(f"\nT = {temperature:g}" + (" (greedy)" if temperature == 0 else "") + "\n" + head + "\n" + "-" * len(head))
    for c in levels:
        base = results[("baseline", temperature, c)]
        line = f"{c:>3} {base.rate:>11.1f}"
        for way in ways[1:]:
            lv = results[(way, temperature, c)]
            line += f" {lv.rate:>11.1f} {lv.rate / base.rate if base.rate else 0:>5.2f}x"
        for way in ways:
            lv = results[(way, temperature, c)]
            line += (f" {ms(lv.pct('ttft', 50)) + '/' + ms(lv.pct('ttft', 99)):>21}"
                     f" {ms(lv.pct('itl', 50)) + '/' + ms(lv.pct('itl', 99)):>20}")
        shares = []
        for way in ways[1:]:
            s = results[(way, temperature, c)].summary().get("self_decoded_share")
            shares.append(f"{way} {s:.0%}" if s is not None else f"{way} -")
        print(line + "  " + ", ".join(shares))
    for way in ways[1:]:
        print(f"verifier per level ({way}): c, draft tokens, accepted, self-decoded, forward passes, "
              "mean batch, forward s, verify s, log append s, wall s, queue wait s (summed over jobs)")
        for c in levels:
            v = results[(way, temperature, c)].verifier
            passes = v.get("sdcp_forward_seconds_count", 0.0)
            mean_batch = v.get("sdcp_batch_size_sum", 0.0) / passes if passes else 0.0
            print(f"  {c:>3} {v.get('sdcp_spec_decode_num_draft_tokens_total', 0):>7.0f} "
                  f"{v.get('sdcp_spec_decode_num_accepted_tokens_total', 0):>7.0f} "
                  f"{v.get('sdcp_self_decoded_tokens_total', 0):>7.0f} {passes:>6.0f} {mean_batch:>6.1f} "
                  f"{v.get('sdcp_forward_seconds_sum', 0):>8.2f} {v.get('sdcp_kernel_seconds_sum', 0):>8.2f} "
                  f"{v.get('sdcp_commit_log_append_seconds_sum', 0):>8.2f} "
                  f"{results[(way, temperature, c)].wall:>8.2f} {v.get('sdcp_queue_wait_seconds_sum', 0):>8.2f}")
        print(f"CPU per level ({way}): c, cores used by each process over the level's wall time "
              f"(CPU seconds / wall seconds), and the cores left idle of the {os.cpu_count()}")
        for c in levels:
            lv = results[(way, temperature, c)]
            if not lv.roles_cpu or not lv.wall:
                continue
            used = {name: seconds / lv.wall for name, seconds in sorted(lv.roles_cpu.items())}
            idle = max(0.0, (os.cpu_count() or 1) - sum(used.values()))
            base = results[("baseline", temperature, c)]
            alone = f"; the target alone used {base.cpu / base.wall:.2f}" if base.wall else ""
            print(f"  {c:>3} " + " ".join(f"{name} {cores:.2f}" for name, cores in used.items())
                  + f" idle {idle:.2f}{alone}")


def plot(path: str, results: dict, levels: list[int], ways: list[str], temperatures: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"baseline": "target alone, generate() batched", "sdcp": "SDCP (speculation auto)",
             "off": "same deployment, speculation off", "on": "SDCP, speculation on"}
    fig, (rate_ax, itl_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    for t in temperatures:
        style = "-" if t == 0 else "--"
        for n, way in enumerate(ways):
            rows = [results[(way, t, c)] for c in levels]
            label = f"{names[way]}, T={t:g}"
            rate_ax.plot(levels, [r.rate for r in rows], style, marker="o", color=f"C{n}", label=label)
            itl_ax.plot(levels, [1000 * r.pct("itl", 50) for r in rows], style, marker="o", color=f"C{n}",
                        label=label)
    for ax, ylabel in ((rate_ax, "output tokens/s"), (itl_ax, "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streamed requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    itl_ax.set_yscale("log")   # the batched baseline's steps grow with the batch; the servers' stay near flat
    rate_ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M behind the OpenAI door vs transformers generate() (bench/bench_serve.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------- the run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,2,4,8,16,32,64", help=f"concurrency levels (at most {len(TEXTS)})")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (or end of turn)")
    ap.add_argument("--temperatures", default="0,0.7", help="0: greedy (rule 1, checked against the target)")
    ap.add_argument("--modes", default="sdcp,off", help=f"deployments to drive: {', '.join(MODES)}")
    ap.add_argument("--drafters", type=int, default=2)
    ap.add_argument("--draft", help="the drafters' model spec (default: real_pair.choose_draft())")
    ap.add_argument("--repeat", type=int, default=1, help="waves per level")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--plot", help="write a PNG of tokens/s and ITL against concurrency here")
    ap.add_argument("--batch-log", help="the verifier writes one JSON line per verify batch here "
                    "(start, end, sessions, waits, forward/kernel/commit ms)")
    ap.add_argument("--no-draft-ahead", action="store_true",
                    help="drafters wait for each verdict instead of drafting ahead on the likely one")
    ap.add_argument("--verifier-option", action="append", default=[], metavar="MEMBER=VALUE",
                    help="set a [verifier] member of every deployment (A/B runs), e.g. company_share=2")
    ap.add_argument("--rounds-log", action="store_true",
                    help="the drafters log every verdict (draft, sent, answered times) in their work "
                    "directories (with --workdir)")
    ap.add_argument("--m-max", type=int, default=8, help="the contract's m_max (longest proposal)")
    ap.add_argument("--warmup-waves", type=int, default=1,
                    help="untimed waves of each level on each deployment before its measured waves (the "
                    "verifier's measured way at a load settles over its first blocks of rounds there; "
                    "0: measure each level from its first wave)")
    ap.add_argument("--no-settle", action="store_true",
                    help="measure from the first rounds: no one-request waves before the levels while the "
                    "drafters choose whether drafting ahead pays (their warm-up)")
    ap.add_argument("--workdir", help="keep the deployments' work directories here (default: temporary)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: levels 1,4, max-tokens 24")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip generate() one prompt at a time: greedy answers are not checked (A/B runs)")
    args = ap.parse_args()
    if args.quick:
        args.levels, args.max_tokens = "1,4", 24
    levels = sorted({int(x) for x in args.levels.split(",")})
    temperatures = [float(x) for x in args.temperatures.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES] or [c for c in levels if not 1 <= c <= len(TEXTS)]:
        ap.error(f"unknown mode or level out of range: {bad}")

    from sdcp_fast.config import VerifierSection
    from sdcp_fast.models import load_backend
    from sdcp_fast.models.hf import library_spec

    if "speculation" not in VerifierSection.__dataclass_fields__:
        skipped = [m for m in modes if m != "sdcp"]
        if skipped:
            print(f"note: this tree's verifier has no `speculation` member yet: modes {skipped} skipped")
        modes = [m for m in modes if m == "sdcp"]

    def load() -> str:
        a, b, c = os.getloadavg()
        return f"load average {a:.2f} {b:.2f} {c:.2f}"

    print(f"bench_serve: {load()}; {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (default) for generate(); driver: {DRIVER}")
    with progress(f"loading the target {TARGET}"):
        target = load_backend(library_spec(TARGET))   # generate() as the library ships it
    draft_spec = args.draft or choose_draft()[0]
    with progress(f"loading the draft {draft_spec} (for its digest)"):
        draft_digest = load_backend(draft_spec).digest.hex()
    eos = end_of_turn(target.tokenizer)
    texts = TEXTS[:max(levels)]
    prompts = chat_prompts(target.tokenizer, texts)
    model = target.model
    print(f"{len(texts)} held-out chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens); "
          f"max_tokens {args.max_tokens} or end of turn; levels {levels}; T {temperatures}; modes {modes}; "
          f"draft {draft_spec} x {args.drafters}; {args.repeat} wave(s) a level")

    reference_texts: list[str] = []
    if 0.0 in temperatures and not args.no_reference:
        with progress(f"the reference: generate(), greedy, the {len(prompts)} prompts one at a time"):
            reference = generate_each(model, prompts, args.max_tokens, eos)
        reference_texts = [target.decode([t for t in out if t != eos]) for out in reference.outputs]

    results: dict[tuple[str, float, int], Level] = {}
    alone_batch(model, [prompts[0]], 4, eos, 0.0)   # warm-up, untimed
    different: dict[str, list[int]] = {}
    failed = 0
    with deployment.work_directory(args.workdir) as root, contextlib.ExitStack() as running:
        deployed = {}   # mode -> (front door, verifier metrics URL, role -> pid)
        for mode in modes:
            cluster, front, metrics_url = start_deployment(root, mode, draft_spec, draft_digest,
                                                           args.max_tokens, eos, args.drafters, args.batch_log,
                                                           draft_ahead=not args.no_draft_ahead,
                                                           verifier_options=dict(o.split("=", 1) for o in args.verifier_option),
                                                           m_max=args.m_max, rounds_log=args.rounds_log)
            running.callback(cluster.stop)
            asyncio.run(drive(front, texts[:1], 4, 0.0, 1, metrics_url, "warm-up"))
            if mode != "off" and not args.no_draft_ahead and not args.no_settle:
                with progress(f"{mode}: one-request waves until the drafters choose whether to draft ahead"):
                    print(f"  {settle_drafting_ahead(cluster, front, metrics_url, args.max_tokens, mode)}",
                          flush=True)
            deployed[mode] = front, metrics_url, {name: i.pid for name, i in cluster.instances.items()}
        for t in temperatures:
            torch.manual_seed(0)
            for c in levels:
                for way in ("baseline", *modes):
                    results[way, t, c] = Level(way, t, c)
                for mode, (front, metrics_url, _) in deployed.items():
                    for wave_seed in range(args.warmup_waves):   # untimed: each level in steady state
                        with progress(f"{mode}: a warm-up wave of {c} (untimed), T = {t:g}"):
                            asyncio.run(drive(front, texts[:c], args.max_tokens, t, 1, metrics_url, mode,
                                              first_wave=1000 + wave_seed))
                for wave in range(args.repeat):
                    with progress(f"the target alone: generate(), {c} prompt(s) in one batch, T = {t:g}"):
                        cpu = time.process_time()
                        answers = alone_batch(model, prompts[:c], args.max_tokens, eos, t)
                        alone = Level("baseline", t, c, answers, max(a.last for a in answers) - answers[0].sent,
                                      cpu=time.process_time() - cpu)
                        results["baseline", t, c].add(alone)
                    print(f"  {alone.rate:.1f} tokens/s", flush=True)
                    for mode, (front, metrics_url, pids) in deployed.items():
                        with progress(f"{mode}: {c} streamed chat completion(s) at once, T = {t:g}"):
                            level = asyncio.run(drive(front, texts[:c], args.max_tokens, t, 1,
                                                      metrics_url, mode, pids, first_wave=wave))
                        results[mode, t, c].add(level)
                        errors = [a.error for a in level.answers if a.error]
                        print(f"  {level.rate:.1f} tokens/s, {level.tokens} tokens"
                              + (f"; {len(errors)} request(s) FAILED, e.g. {errors[0]}" if errors else ""),
                              flush=True)
                        failed += len(errors)
                        if t == 0 and reference_texts:
                            for n, answer in enumerate(level.answers):
                                if answer.text != reference_texts[n % c]:
                                    different.setdefault(f"{mode} c={c}", []).append(n % c + 1)

    print(f"\n{load()}; driver: {DRIVER}")
    ways = ["baseline", *modes]
    for t in temperatures:
        table(results, t, levels, ways)
    for where, which in different.items():
        print(f"greedy outputs that differ from the target alone: {where}: prompts {sorted(set(which))}")
        n = which[0] - 1
        level = results[where.split()[0], 0.0, int(where.split("=")[1])]
        print(f"  prompt {n + 1}: reference {reference_texts[n][:160]!r}\n"
              f"             got       {level.answers[n].text[:160]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "driver": DRIVER, "target": TARGET, "draft": draft_spec, "drafters": args.drafters,
            "levels": levels, "temperatures": temperatures, "modes": modes, "max_tokens": args.max_tokens,
            "repeat": args.repeat, "load_average_end": os.getloadavg(), "identical_differences": different,
            "levels_figures": [lv.summary() for lv in results.values()],
            "answers": {f"{k[0]} T={k[1]:g} c={k[2]}": [dataclasses.asdict(a) for a in lv.answers]
                        for k, lv in results.items()}}, indent=1))
        print(f"figures in {args.json}")
    if args.plot:
        plot(args.plot, results, levels, ways, temperatures)
        print(f"plot in {args.plot}")
    if failed:
        print(f"{failed} request(s) failed (see the lines above)")
    if "sdcp" not in modes:
        return 1 if failed else 0

    def ratios(t: float) -> tuple[str, float]:
        rs = [results["sdcp", t, c].rate / results["baseline", t, c].rate if results["baseline", t, c].rate else 0.0
              for c in levels]
        return " ".join(f"c={c} {r:.2f}x" for c, r in zip(levels, rs, strict=True)), min(rs)

    split = " ".join(f"c={c} {results['sdcp', t, c].per_cpu_second / results['baseline', t, c].per_cpu_second:.2f}x"
                     for t in temperatures[:1] for c in levels if results["baseline", t, c].per_cpu_second)
    print(f"split-drafting view (tokens per CPU second of the verifier's process over the target alone's, "
          f"T={temperatures[0]:g}; drafting on other hosts): {split}")
    for t in temperatures:
        if t != 0:
            line, low = ratios(t)
            print(f"serve T={t:g}: {line} vs the target alone on the whole machine (min {low:.2f}x)")
    if 0.0 in temperatures:
        line, low = ratios(0.0)
        print(f"serve: {line} vs the target alone on the whole machine (min {low:.2f}x), "
              f"identical {'not checked' if args.no_reference else 'no' if different else 'yes'}")
    return 1 if failed or different else 0


if __name__ == "__main__":
    sys.exit(main())
