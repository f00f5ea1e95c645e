"""`sdcp-fast serve ROLE --config FILE`: one verifier, drafter or router instance.

The composition root of one process: reads the instance's TOML file (schema in config.py),
builds the role's service over its model, cache, commit log and client, serves it over
HTTP/2 + HTTP/3 with mutual TLS (`transport.serve`), and the plain-HTTP pages it has (the
router's front door, the verifier's metrics) with `transport.asgi.serve_web`.

SIGTERM or SIGINT stops the instance gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .config import ConfigError, InstanceConfig, load

log = logging.getLogger("sdcp_fast.serve")
Closer = Callable[[], Awaitable[object]]


@dataclass
class Built:
    """A role's service, what to close after it, and what its ready file adds."""

    service: object
    closers: list[Closer] = field(default_factory=list)
    ready: dict[str, object] = field(default_factory=dict)
    count_refusal: Callable[[str], None] | None = None   # the transport's refusals, into metrics


def host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen_address(cfg: InstanceConfig) -> tuple[str, int]:
    if cfg.listen:
        return host_port(cfg.listen)
    parts = urlsplit(cfg.uri)
    return parts.hostname or "127.0.0.1", parts.port or 443


def commit_log_spec(cfg: InstanceConfig) -> str:
    if not cfg.commit_log:
        raise ConfigError("missing 'commit_log'")
    return cfg.commit_log


# ---------------------------------------------------------------------- building each role


async def build_verifier(cfg: InstanceConfig, tls, client) -> Built:
    from .cache import open_log, open_store
    from .models import load_backend
    from .transport.asgi import serve_web
    from .verifier import EngineConfig, MetricsPage, VerifierConfig, VerifierService

    v = cfg.section("verifier")
    config = VerifierConfig(
        uri=cfg.uri, routers=frozenset(v.routers), router_uri=v.router_uri,
        output_wait_s=v.output_wait_s, status_interval_s=v.status_interval_s, ttl_ms=v.ttl_ms,
        publish_kv_every=v.publish_kv_every, max_sessions=v.max_sessions,
        memory_budget_bytes=v.session_memory_mb << 20, retire_idle_s=v.retire_idle_s,
        max_context_tokens=v.max_context_tokens, idle_s=v.idle_s)
    backend = load_backend(cfg.model)
    store = await open_store(cfg.store)
    commit_log = await open_log(commit_log_spec(cfg))
    service = VerifierService(config, backend, store, commit_log, client=client,
                              engine_config=EngineConfig(max_batch=v.max_batch, max_wait_ms=v.max_wait_ms))
    closers: list[Closer] = [store.close, commit_log.close]
    if v.metrics:
        host, port = host_port(v.metrics)
        page = await serve_web(MetricsPage(service.metrics), host=host, port=port)
        closers.insert(0, page.stop)
    return Built(service, closers, count_refusal=lambda kind: service.metrics.inc("refusals_total", kind=kind))


async def build_drafter(cfg: InstanceConfig, tls, client) -> Built:
    from .cache import open_store
    from .drafter import DrafterConfig, DrafterService
    from .models import load_backend

    d = cfg.section("drafter")
    config = DrafterConfig(
        uri=cfg.uri, routers=frozenset(d.routers), router_uri=d.router_uri, ttl_ms=d.ttl_ms,
        status_interval_s=d.status_interval_s, max_sessions=d.max_sessions, max_batch=d.max_batch,
        request_timeout_s=d.request_timeout_s, give_up_after_s=d.give_up_after_s,
        max_q_republish=d.max_q_republish, publish_draft_kv=d.publish_draft_kv,
        draft_kv_every=d.draft_kv_every, draft_ahead=d.draft_ahead, rounds_log=d.rounds_log,
        drop_verdicts=d.drop_verdicts, memory_budget_bytes=d.session_memory_mb << 20,
        max_context_tokens=d.max_context_tokens)
    backend = load_backend(cfg.model)
    store = await open_store(cfg.store)
    return Built(DrafterService(config, backend, store, client=client), [store.close])


def contract_defaults(c):
    """The router's ContractDefaults from a [router.contract] table (config.ContractSection)."""
    from .core.messages import Action, Sampling
    from .core.problems import ProblemError
    from .router import ContractDefaults

    try:
        sampling = Sampling.from_obj(c.sampling) if c.sampling else None
    except ProblemError as exc:
        raise ConfigError(f"contract.sampling: {exc}") from None
    return ContractDefaults(
        rule=c.rule, m_max=c.m_max, max_new=c.max_new, stop=tuple(c.stop), low_rounds=c.low_rounds,
        low_ratio=c.low_ratio, fallback=tuple(Action[name.upper()] for name in c.fallback),
        self_load=c.self_load, self_max=c.self_max, sampling=sampling)


async def build_router(cfg: InstanceConfig, tls, client) -> Built:
    from .cache import open_log, open_store
    from .models import load_backend
    from .router import FrontDoor, RouterConfig, RouterService
    from .transport.asgi import serve_web

    r = cfg.section("router")
    drafters = []
    for entry in r.drafters:
        digest = entry.model_digest or (load_backend(entry.model).digest.hex() if entry.model else "")
        if not digest:
            raise ConfigError(f"router.drafters: {entry.uri} needs model or model_digest")
        drafters.append((entry.uri, bytes.fromhex(digest)))
    config = RouterConfig(
        uri=cfg.uri, verifiers=tuple(r.verifiers), drafters=tuple(drafters), m_init=r.m_init,
        monitor_interval_s=r.monitor_interval_s, stall_s=r.stall_s, request_timeout_s=r.request_timeout_s,
        target_kv=r.target_kv, session_load=r.session_load, contract=contract_defaults(r.contract))
    backend = load_backend(cfg.model)
    store = await open_store(cfg.store)
    commit_log = await open_log(commit_log_spec(cfg))
    service = RouterService(config, backend, store, commit_log, client=client)
    built = Built(service, [store.close, commit_log.close])
    if r.frontdoor:
        host, port = host_port(r.frontdoor)
        door = await serve_web(FrontDoor(service), host=host, port=port,
                               tls=tls if r.frontdoor_tls else None)
        built.closers.insert(0, door.stop)
        built.ready["frontdoor_port"] = door.port
    return built


BUILDERS = {"verifier": build_verifier, "drafter": build_drafter, "router": build_router}


# ---------------------------------------------------------------------- running


async def run(role: str, cfg: InstanceConfig, where: str = "config") -> int:
    from .transport import Client, Refusals, TLSConfig, serve

    if cfg.role and cfg.role != role:
        raise ConfigError(f"{where} is a {cfg.role} config, not a {role} one")
    tls = TLSConfig.for_instance(cfg.certs, cfg.uri)
    client = Client(tls, cfg.protocol, timeout=10.0)
    try:
        built = await BUILDERS[role](cfg, tls, client)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    service = built.service
    await service.start()
    host, port = listen_address(cfg)
    server = await serve(service, host=host, port=port, tls=tls, http3=cfg.http3, http2=cfg.http2,
                         limits=cfg.transport, refusals=Refusals(on_count=built.count_refusal))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cfg.ready_file:
        info = {"uri": cfg.uri, "port": server.port, "pid": os.getpid(), **built.ready}
        tmp = Path(cfg.ready_file + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(cfg.ready_file)
    log.info("%s %s serving on %s:%d", role, cfg.uri, host, server.port)
    await stop.wait()
    log.info("%s %s stopping", role, cfg.uri)
    await server.stop(grace=1.0)
    await service.stop()
    for close in built.closers:
        try:
            await close()
        except Exception as exc:   # closing is best effort: the process ends anyway
            log.debug("close failed: %s", exc)
    await client.close()
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.config, args.role)
    except ConfigError as exc:
        print(f"sdcp-fast serve: {exc}", file=sys.stderr)
        return 2
    level = getattr(logging, cfg.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s")
    # aioquic logs every stream a client resets at INFO: under attack that is one line per
    # request; the transport's own refusal lines are rate-limited instead (refusals.py)
    logging.getLogger("quic").setLevel(max(level, logging.WARNING))
    try:
        return asyncio.run(run(args.role, cfg, Path(args.config).name))
    except ConfigError as exc:
        print(f"sdcp-fast serve: {exc}", file=sys.stderr)
        return 2
