"""`sdcp-fast serve ROLE --config FILE`: one verifier, drafter or router instance.

The composition root of one process: reads the instance's TOML file (schema in config.py),
builds the role's service over its model, cache, commit log and client, serves it over
HTTP/2 + HTTP/3 with mutual TLS (`transport.serve`, under the config's `[transport]`
limits, its refusals counted as `sdcp_refusals_total{kind}`), and its plain-HTTP pages with
`transport.asgi.serve_web`: every role's GET /metrics and GET /health (`metrics.StatusPage`
at the role's `metrics` host:port), and the router's front door (its own API, the OpenAI
API, /health and /metrics).

The status page starts first, so /health answers 503 while the model loads; it answers 200
once the instance serves and its object store and commit log answer. Once serving, the
instance logs one line with its URLs (the router's includes `OpenAI API at http://.../v1`).

Bad input is one line on stderr and exit code 2: a config error, a missing certificate
directory, a model that cannot be loaded, a store that cannot be opened, a port in use.
SIGTERM or SIGINT stops the instance gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from . import aio, gcfreeze, heap, logs
from .config import ConfigError, InstanceConfig, load
from .memprobe import MemoryProbe
from .metrics import Health, StatusPage, log_check, refusal_counter, store_check

log = logging.getLogger("sdcp_fast.serve")
Closer = Callable[[], Awaitable[object]]


class StartError(Exception):
    """The instance cannot start for a reason the operator fixes (one line, exit code 2)."""


@dataclass
class Built:
    """A role's service, what to close after it, what its ready file adds, its URLs."""

    service: object
    closers: list[Closer] = field(default_factory=list)
    first: list[Closer] = field(default_factory=list)  # on stop, before the servers stop
    ready: dict[str, object] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)       # "what URL" pieces of the ready line
    count_refusal: Callable[[str], None] | None = None  # the transport's refusals, into the metrics


def host_port(text: str, what: str = "address") -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdecimal():
        raise ConfigError(f"{what}: expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen_address(cfg: InstanceConfig) -> tuple[str, int]:
    if cfg.listen:
        return host_port(cfg.listen, "listen")
    parts = urlsplit(cfg.uri)
    return parts.hostname or "127.0.0.1", parts.port or 443


def commit_log_spec(cfg: InstanceConfig) -> str:
    if not cfg.commit_log:
        raise ConfigError("missing 'commit_log'")
    return cfg.commit_log


def web_url(host: str, port: int, path: str = "", tls: bool = False) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}{path}"


# ---------------------------------------------------------------------- what can fail at start


def load_model(spec: str, what: str = "model"):
    from .models import ModelError, load_backend

    try:
        return load_backend(spec)
    except (OSError, ModelError, ValueError, KeyError, ImportError) as exc:
        raise StartError(f"{what} {spec!r} cannot be loaded: {_reason(exc)}") from None


async def open_session_table(spec: str, log_spec: str):
    from .cache import CacheError, open_table, table_beside_log

    try:
        spec = spec or table_beside_log(log_spec)
        return await open_table(spec)
    except (CacheError, OSError, ValueError) as exc:
        raise StartError(f"session_table {spec!r} cannot be opened: {_reason(exc)}") from None


async def open_stores(cfg: InstanceConfig, *, with_log: bool):
    from .cache import CacheError, open_log, open_store

    try:
        store = await open_store(cfg.store)
    except (CacheError, OSError, ValueError) as exc:
        raise StartError(f"store {cfg.store!r} cannot be opened: {_reason(exc)}") from None
    if not with_log:
        return store, None
    spec = commit_log_spec(cfg)
    try:
        return store, await open_log(spec)
    except (CacheError, OSError, ValueError) as exc:
        await store.close()
        raise StartError(f"commit_log {spec!r} cannot be opened: {_reason(exc)}") from None


async def listen_web(handler, address: str, what: str, *, tls=None):
    """serve_web at a config's host:port; a port in use is a StartError."""
    from .transport.asgi import serve_web

    host, port = host_port(address, what)
    try:
        return host, await serve_web(handler, host=host, port=port, tls=tls)
    except OSError as exc:
        raise StartError(f"{what}: cannot listen on {host}:{port}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


async def status_page(address: str, registry, health: Health, built: Built) -> None:
    """The role's /metrics and /health at `address` (empty: none)."""
    if not address:
        return
    host, page = await listen_web(StatusPage(registry, health), address, "metrics")
    built.closers.insert(0, page.stop)
    built.ready["metrics_port"] = page.port
    built.urls.append(f"metrics {web_url(host, page.port, '/metrics')}")
    built.urls.append(f"health {web_url(host, page.port, '/health')}")


# ---------------------------------------------------------------------- building each role


async def open_role(cfg: InstanceConfig, metrics, address: str, health: Health, *, with_log: bool):
    """What every role starts with: its Built (refusals counted in `metrics`), its status page
    at `address`, its model, and its store and commit log (closed with the role, checked by
    /health); (built, backend, store, commit_log or None)."""
    built = Built(None, count_refusal=refusal_counter(metrics.registry))
    await status_page(address, metrics.registry, health, built)
    backend = await aio.compute(load_model, cfg.model)   # torch's own set-up on the compute thread
    store, commit_log = await open_stores(cfg, with_log=with_log)
    built.closers.append(store.close)
    health.add("store", store_check(store))
    if commit_log is not None:
        built.closers.append(commit_log.close)
        health.add("commit_log", log_check(commit_log))
    return built, backend, store, commit_log


async def build_verifier(cfg: InstanceConfig, tls, client, health: Health) -> Built:
    from .verifier import EngineConfig, Metrics, VerifierConfig, VerifierService

    v = cfg.section("verifier")
    config = VerifierConfig(
        uri=cfg.uri, routers=frozenset(v.routers), router_uri=v.router_uri, router_uris=tuple(v.router_uris),
        output_wait_s=v.output_wait_s, status_interval_s=v.status_interval_s, ttl_ms=v.ttl_ms,
        publish_kv_every=v.publish_kv_every, max_sessions=v.max_sessions,
        memory_budget_bytes=v.session_memory_mb << 20, retire_idle_s=v.retire_idle_s,
        max_context_tokens=v.max_context_tokens, idle_s=v.idle_s)
    metrics = Metrics()
    built, backend, store, commit_log = await open_role(cfg, metrics, v.metrics, health, with_log=True)
    built.service = VerifierService(config, backend, store, commit_log, client=client, metrics=metrics,
                                    engine_config=EngineConfig(max_batch=v.max_batch, max_wait_ms=v.max_wait_ms,
                                                               group_commit=v.group_commit,
                                                               company_share=v.company_share,
                                                               batch_log=v.batch_log,
                                                               speculation=v.speculation,
                                                               first_token=v.first_token))
    return built


async def build_drafter(cfg: InstanceConfig, tls, client, health: Health) -> Built:
    from .drafter import DrafterConfig, DrafterService
    from .drafter.metrics import Metrics

    d = cfg.section("drafter")
    config = DrafterConfig(
        uri=cfg.uri, routers=frozenset(d.routers), router_uri=d.router_uri, router_uris=tuple(d.router_uris),
        ttl_ms=d.ttl_ms,
        status_interval_s=d.status_interval_s, max_sessions=d.max_sessions, max_batch=d.max_batch,
        request_timeout_s=d.request_timeout_s, give_up_after_s=d.give_up_after_s,
        max_q_republish=d.max_q_republish, publish_draft_kv=d.publish_draft_kv,
        draft_kv_every=d.draft_kv_every, draft_ahead=d.draft_ahead, rounds_log=d.rounds_log,
        drop_verdicts=d.drop_verdicts, memory_budget_bytes=d.session_memory_mb << 20,
        max_context_tokens=d.max_context_tokens)
    metrics = Metrics()
    built, backend, store, _ = await open_role(cfg, metrics, d.metrics, health, with_log=False)
    built.service = DrafterService(config, backend, store, client=client, metrics=metrics)
    return built


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


def served_model_name(spec: str) -> str:
    """The OpenAI API's name of a model: the demo name, or the last part of its path
    (without the file suffix): tiny:demo-target -> demo-target, hf:/m/SmolLM2 -> SmolLM2."""
    kind, _, arg = spec.partition(":")
    arg = arg.partition("?")[0]   # options (hf:smollm2?max_seq_len=512) are not part of the name
    name = Path(arg.rstrip("/")).name or arg
    return name if kind == "hf" else Path(name).stem


async def build_router(cfg: InstanceConfig, tls, client, health: Health) -> Built:
    from .core.messages import ROLE_DRAFTER, ROLE_VERIFIER
    from .router import FrontDoor, OpenAIRoutes, RouterConfig, RouterService
    from .router.metrics import Metrics

    r = cfg.section("router")
    drafters = []
    for entry in r.drafters:
        if entry.model_digest:
            try:
                digest = bytes.fromhex(entry.model_digest)
            except ValueError:
                raise ConfigError(f"router.drafters: {entry.uri}: model_digest is not hex") from None
        elif entry.model:
            digest = load_model(entry.model, f"router.drafters: {entry.uri}: model").digest
        else:
            raise ConfigError(f"router.drafters: {entry.uri} needs model or model_digest")
        drafters.append((entry.uri, digest))
    try:
        config = RouterConfig(
            uri=cfg.uri, verifiers=tuple(r.verifiers), drafters=tuple(drafters), m_init=r.m_init,
            monitor_interval_s=r.monitor_interval_s, stall_s=r.stall_s, request_timeout_s=r.request_timeout_s,
            open_timeout_s=r.open_timeout_s, target_kv=r.target_kv, session_load=r.session_load,
            lease_ttl_s=r.lease_ttl_s, status_grace_s=r.status_grace_s, max_running=r.max_running,
            max_waiting=r.max_waiting, itl_target_ms=r.itl_target_ms, admission_interval_s=r.admission_interval_s,
            contract=contract_defaults(r.contract))
    except ValueError as exc:
        raise ConfigError(f"router.{exc}") from None
    metrics = Metrics()
    built, backend, store, commit_log = await open_role(cfg, metrics, r.metrics, health, with_log=True)
    table = await open_session_table(r.session_table, commit_log_spec(cfg))
    built.closers.append(table.close)
    service = built.service = RouterService(config, backend, store, commit_log, client=client, table=table,
                                            metrics=metrics)
    health.add("lease", service.own.health_check)
    built.first.append(service.stop)    # hand the sessions over at once: another router takes them
    health.details = lambda: {"verifiers_live": len(service.registry.live(ROLE_VERIFIER)),
                              "drafters_live": len(service.registry.live(ROLE_DRAFTER))}
    if r.frontdoor:
        name = r.served_model_name or served_model_name(cfg.model)
        try:
            routes = OpenAIRoutes(service, name, logprobs_mode=r.logprobs_mode)
        except ValueError as exc:
            raise ConfigError(f"router.{exc}") from None
        door = FrontDoor(service, openai=routes, status=StatusPage(metrics.registry, health))
        host, page = await listen_web(door, r.frontdoor, "frontdoor", tls=tls if r.frontdoor_tls else None)
        built.closers.insert(0, page.stop)
        built.ready["frontdoor_port"] = page.port
        built.ready["model_name"] = name
        built.urls[:0] = [f"OpenAI API at {web_url(host, page.port, '/v1', r.frontdoor_tls)}",
                          f"metrics {web_url(host, page.port, '/metrics', r.frontdoor_tls)}"]
    return built


BUILDERS = {"verifier": build_verifier, "drafter": build_drafter, "router": build_router}
COMPUTING_ROLES = ("verifier", "drafter")   # roles that run a model's passes


# ---------------------------------------------------------------------- running


def tls_for(cfg: InstanceConfig):
    from .transport import TLSConfig

    if not Path(cfg.certs).is_dir():
        raise StartError(f"certs: no directory {cfg.certs!r} (create it with `sdcp-fast certs`)")
    try:
        return TLSConfig.for_instance(cfg.certs, cfg.uri)
    except (OSError, ValueError) as exc:
        raise StartError(f"certs: no certificate for {cfg.uri} in {cfg.certs}: {_reason(exc)}") from None


async def run(role: str, cfg: InstanceConfig, where: str = "config") -> int:
    from .transport import Client, Refusals, serve

    if cfg.role and cfg.role != role:
        raise ConfigError(f"{where} is a {cfg.role} config, not a {role} one")
    if role in COMPUTING_ROLES:   # the loop's worker threads: torch on one thread (cores.py)
        from .cores import single_threaded_worker
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="sdcp-io", initializer=single_threaded_worker))
    tls = tls_for(cfg)
    health = Health()
    client = Client(tls, cfg.protocol, timeout=10.0)
    built = Built(None)
    server = service = None
    try:
        try:
            built = await BUILDERS[role](cfg, tls, client, health)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        service = built.service
        await service.start()
        host, port = listen_address(cfg)
        try:
            server = await serve(service, host=host, port=port, tls=tls, http3=cfg.http3, http2=cfg.http2,
                                 limits=cfg.transport, refusals=Refusals(on_count=built.count_refusal))
        except OSError as exc:
            raise StartError(f"listen: cannot listen on {host}:{port}: {_reason(exc)}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        probe = MemoryProbe.from_env(role)       # SDCP_TRACEMALLOC=N: memprobe.py
        probing = loop.create_task(probe.run()) if probe is not None else None
        trimming = loop.create_task(heap.keep_trimmed(heap.trim_period()))   # free pages back: heap.py
        gcfreeze.freeze_startup_objects()        # full collections stop walking start-up's objects
        health.mark_ready()
        if cfg.ready_file:
            info = {"uri": cfg.uri, "port": server.port, "pid": os.getpid(), **built.ready}
            tmp = Path(cfg.ready_file + ".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(cfg.ready_file)
        protocols = " + ".join(p for p, on in (("HTTP/2", cfg.http2), ("HTTP/3", cfg.http3)) if on)
        log.info("%s ready: %s", role, "; ".join(
            [*built.urls, f"SDCP {cfg.uri} ({protocols} with mutual TLS on {host}:{server.port})"]))
        await stop.wait()
        log.info("%s %s stopping", role, cfg.uri)
        trimming.cancel()
        if probing is not None:
            probing.cancel()
    finally:
        await _shut_down(server, service, built, client)
    return 0


async def _shut_down(server, service, built: Built, client) -> None:
    for first in built.first:
        with contextlib.suppress(Exception):
            await first()
    if server is not None:
        await server.stop(grace=1.0)
    if service is not None:
        with contextlib.suppress(Exception):
            await service.stop()
    for close in built.closers:
        try:
            await close()
        except Exception as exc:   # closing is best effort: the process ends anyway
            log.debug("close failed: %s", exc)
    await client.close()


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.config, args.role)
        logs.setup(cfg.log_level, cfg.log_format, args.role)
        # aioquic logs every stream a client resets at INFO: under attack, a line per request;
        # the transport's own refusal lines are rate-limited instead (transport/refusals.py)
        logging.getLogger("quic").setLevel(max(logging.getLogger().getEffectiveLevel(), logging.WARNING))
        heap.cap_arenas()              # before the worker threads: heap.py
        if args.role in COMPUTING_ROLES:   # torch on the loop thread: one thread (cores.py)
            from .cores import single_threaded_loop
            single_threaded_loop()
        return aio.run(run(args.role, cfg, Path(args.config).name))
    except (ConfigError, StartError) as exc:
        print(f"sdcp-fast serve: {exc}", file=sys.stderr)
        return 2
