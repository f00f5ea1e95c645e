"""Helpers for the role tests: table models, a loopback cluster, a front-door client, and
the greedy reference (rule 1's output is greedy decoding of the target, whatever happens)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import torch

from sdcp_fast.models import load_backend
from sdcp_fast.models.table import write_table
from sdcp_fast.procs import Cluster

V = 32


def wait_until(predicate, timeout: float, what: str, *, interval: float = 0.05):
    """The first truthy value of `predicate()`, polled every `interval` s; TimeoutError(what)
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(interval)


def make_tables(workdir: Path, *, noise: float = 1.0, seed: int = 0) -> tuple[str, str]:
    """(target spec, draft spec): the draft table is the target's plus Gaussian noise, so
    drafts agree with the target often but not always."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 3
    draft = target + noise * torch.randn(V, V, generator=g) * 3
    write_table(workdir / "target.safetensors", target)
    write_table(workdir / "draft.safetensors", draft)
    return f"table:{workdir / 'target.safetensors'}", f"table:{workdir / 'draft.safetensors'}"


def greedy(spec: str, prompt: list[int], max_new: int) -> list[int]:
    backend = load_backend(spec)
    backend.open(b"ref", prompt)
    out = []
    for _ in range(max_new):
        token = int(torch.argmax(backend.score([(b"ref", [])])[-1]))
        backend.commit(b"ref", [token])
        out.append(token)
    return out


def build_cluster(workdir: Path, *, drafters: int = 2, verifiers: int = 1, protocol: str = "h2",
                  noise: float = 1.0, contract: dict | None = None, drafter_options: dict | None = None,
                  router_options: dict | None = None, verifier_options: dict | None = None,
                  commit_log: str | None = None) -> tuple[Cluster, str]:
    target, draft = make_tables(workdir, noise=noise)
    cluster = Cluster(workdir / "cluster", protocol=protocol, log_level="info", commit_log=commit_log)
    for n in range(1, verifiers + 1):
        options = {k: v for k, v in (verifier_options or {}).items() if not k.startswith("v")}
        options.update((verifier_options or {}).get(f"v{n}", {}))   # {"v1": {...}}: for v1 only
        cluster.verifier(f"v{n}", model=target, **{"speculation": "on", **options})   # the protocol's rounds
    digest = load_backend(draft).digest.hex()
    for n in range(1, drafters + 1):
        options = dict(drafter_options or {})
        options.update(options.pop(f"d{n}", {}))
        cluster.drafter(f"d{n}", model=draft, **{k: v for k, v in options.items() if not k.startswith("d")
                                                 or k in ("draft_ahead", "draft_kv_every", "drop_verdicts")})
    cluster.router(model=target, drafter_models={f"d{n}": digest for n in range(1, drafters + 1)},
                   contract={"rule": 1, "m_max": 6, "max_new": 120, "low_rounds": 4,
                             "fallback": ["reduce", "switch"], **(contract or {})},
                   **(router_options or {}))
    return cluster, target


class FrontDoorClient:
    def __init__(self, base: str, timeout: float = 60.0):
        self.base = base
        self.http = httpx.Client(timeout=timeout)

    def generate(self, tokens: list[int], **fields) -> dict:
        """Stream one generation; returns {"id", "tokens", "events", "end"}."""
        events = []
        with self.http.stream("POST", f"{self.base}/v1/generate", json={"tokens": tokens, **fields}) as r:
            r.raise_for_status()
            events = list(parse_sse(r.iter_lines()))
        start = next(e for name, e in events if name == "start")
        streamed = []
        for name, e in events:
            if name == "tokens":
                assert e["index"] == len(streamed), (e["index"], len(streamed))   # no gap, no repeat
                streamed.extend(e["tokens"])
        end = next(e for name, e in events if name == "end")
        return {"id": start["id"], "tokens": streamed, "events": events, "end": end}

    def info(self, gid: str) -> dict:
        return self.http.get(f"{self.base}/v1/generations/{gid}").json()

    def generations(self) -> list[dict]:
        return self.http.get(f"{self.base}/v1/generations").json()["generations"]

    def instances(self) -> list[dict]:
        return self.http.get(f"{self.base}/v1/instances").json()["instances"]

    def wait_live(self, count: int, timeout: float = 30.0) -> None:
        wait_until(lambda: sum(1 for i in self.instances() if i["live"]) >= count, timeout,
                   f"fewer than {count} instances live", interval=0.1)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """The router's own /health: 200 once it holds a lease on the session table."""
        wait_until(lambda: self.http.get(f"{self.base}/health").status_code == 200, timeout,
                   "the router's /health is not 200", interval=0.1)

    def close(self) -> None:
        self.http.close()


def parse_sse(lines):
    name, data = None, []
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and name is not None:
            yield name, json.loads("\n".join(data))
            name, data = None, []


def rounds(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
