"""`sdcp-fast serve ROLE --config FILE`: one verifier, drafter or router instance.

One TOML file per instance. Members common to every role:

    uri        = "https://127.0.0.1:9201/"  # base URI; the URI SAN of the instance's certificate
    listen     = "127.0.0.1:9201"           # host:port to bind (default: the URI's host and port)
    certs      = "/path/certs"              # ca.pem + <name>.pem/.key (`sdcp-fast certs`)
    protocol   = "h2"                       # how this instance calls its peers: "h2" or "h3"
    http3      = true                       # also serve HTTP/3 on the same port (UDP)
    model      = "tiny:demo-target"         # verifier: target; drafter: draft; router: target
                                            # (the router uses its tokenizer and digests)
    store      = "embedded:/dev/shm/x"      # object store (cache references)
    commit_log = "file:/var/lib/sdcp/log"   # verifier and router
    ready_file = "/tmp/v1.ready"            # optional: JSON {"uri", "port", "pid"} once serving
    log_level  = "info"

    [verifier]   routers = [URI...], router_uri, output_wait_s = 5.0, ttl_ms = 3000,
                 status_interval_s = 1.0, publish_kv_every = 0 (rounds; 0: never),
                 max_batch = 64,
                 max_wait_ms = 2.0, metrics = "127.0.0.1:9300" (optional)
    [drafter]    routers = [URI...], router_uri, ttl_ms = 2000, status_interval_s = 0.5,
                 max_sessions = 64, max_batch = 32, publish_draft_kv = true,
                 draft_kv_every = 8, draft_ahead = true, rounds_log = PATH,
                 request_timeout_s = 5.0, give_up_after_s = 10.0 (no verdict: stop),
                 max_q_republish = 3, drop_verdicts = 0 (test hook)
    [router]     verifiers = [URI...], frontdoor = "127.0.0.1:8080", frontdoor_tls = false,
                 m_init = 4, stall_s = 5.0, monitor_interval_s = 0.1, target_kv = true,
                 session_load = 5
      [[router.drafters]]  uri = URI, and model = "tiny:demo-draft" or model_digest = HEX
      [router.contract]    rule, m_max, max_new, stop = [ids], low_rounds, low_ratio,
                           fallback = ["reduce", "switch", "self_decode", "fail"],
                           self_load, self_max, and a [router.contract.sampling] table

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
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("sdcp_fast.serve")
ROLES = ("verifier", "drafter", "router")


class ConfigError(ValueError):
    """A config file that is missing a member or has one of the wrong type."""


class Section:
    """Typed access to one TOML table, naming the member in every error."""

    def __init__(self, data: dict[str, Any], where: str):
        self.data, self.where = data, where

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise ConfigError(f"{self.where}: missing {key!r}")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            raise ConfigError(f"{self.where}.{key}: expected {getattr(kind, '__name__', kind)}, "
                              f"got {type(value).__name__}")
        return value

    def table(self, key: str) -> Section:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            raise ConfigError(f"{self.where}.{key}: expected a table")
        return Section(value, f"{self.where}.{key}")

    def uris(self, key: str, default: Any = ...) -> tuple[str, ...]:
        value = self.get(key, list, default)
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.where}.{key}: expected a list of URIs")
        return tuple(value)


def load_config(path: str | Path) -> Section:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return Section(data, Path(path).name)


def listen_address(cfg: Section) -> tuple[str, int]:
    listen = cfg.get("listen", str, "")
    if listen:
        host, _, port = listen.rpartition(":")
        return host.strip("[]"), int(port)
    parts = urlsplit(cfg.get("uri", str))
    return parts.hostname or "127.0.0.1", parts.port or 443


def host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


# ---------------------------------------------------------------------- building each role


async def build_verifier(cfg: Section, tls, client):
    from .cache import open_log, open_store
    from .models import load_backend
    from .verifier import EngineConfig, VerifierConfig, VerifierService, serve_metrics

    v = cfg.table("verifier")
    config = VerifierConfig(
        uri=cfg.get("uri", str), routers=frozenset(v.uris("routers")),
        router_uri=v.get("router_uri", str, None), output_wait_s=v.get("output_wait_s", float, 5.0),
        status_interval_s=v.get("status_interval_s", float, 1.0), ttl_ms=v.get("ttl_ms", int, 3000),
        publish_kv_every=v.get("publish_kv_every", int, 0))
    backend = load_backend(cfg.get("model", str))
    store = await open_store(cfg.get("store", str))
    commit_log = await open_log(cfg.get("commit_log", str))
    service = VerifierService(config, backend, store, commit_log, client=client,
                              engine_config=EngineConfig(max_batch=v.get("max_batch", int, 64),
                                                         max_wait_ms=v.get("max_wait_ms", float, 2.0)))
    closers = [store.close, commit_log.close]
    metrics = v.get("metrics", str, "")
    if metrics:
        server = await serve_metrics(service.metrics, *host_port(metrics))

        async def close_metrics():
            server.close()
        closers.append(close_metrics)
    return service, closers


async def build_drafter(cfg: Section, tls, client):
    from .cache import open_store
    from .drafter import DrafterConfig, DrafterService
    from .models import load_backend

    d = cfg.table("drafter")
    config = DrafterConfig(
        uri=cfg.get("uri", str), routers=frozenset(d.uris("routers")),
        router_uri=d.get("router_uri", str, None), ttl_ms=d.get("ttl_ms", int, 2000),
        status_interval_s=d.get("status_interval_s", float, 0.5),
        max_sessions=d.get("max_sessions", int, 64), max_batch=d.get("max_batch", int, 32),
        request_timeout_s=d.get("request_timeout_s", float, 5.0),
        give_up_after_s=d.get("give_up_after_s", float, 10.0),
        max_q_republish=d.get("max_q_republish", int, 3),
        publish_draft_kv=d.get("publish_draft_kv", bool, True),
        draft_kv_every=d.get("draft_kv_every", int, 8), draft_ahead=d.get("draft_ahead", bool, True),
        rounds_log=d.get("rounds_log", str, None), drop_verdicts=d.get("drop_verdicts", int, 0))
    backend = load_backend(cfg.get("model", str))
    store = await open_store(cfg.get("store", str))
    return DrafterService(config, backend, store, client=client), [store.close]


def contract_defaults(c: Section):
    from .core.messages import Sampling
    from .router.service import LADDER_NAMES, ContractDefaults

    names = c.get("fallback", list, ["reduce", "switch", "self_decode"])
    unknown = [n for n in names if n not in LADDER_NAMES]
    if unknown:
        raise ConfigError(f"{c.where}.fallback: unknown actions {unknown} (reduce, switch, self_decode, fail)")
    sampling = c.table("sampling").data
    base = ContractDefaults()
    return ContractDefaults(
        rule=c.get("rule", int, base.rule), m_max=c.get("m_max", int, base.m_max),
        max_new=c.get("max_new", int, base.max_new), stop=tuple(c.get("stop", list, [])),
        low_rounds=c.get("low_rounds", int, base.low_rounds), low_ratio=c.get("low_ratio", int, None),
        fallback=tuple(LADDER_NAMES[n] for n in names), self_load=c.get("self_load", int, base.self_load),
        self_max=c.get("self_max", int, base.self_max),
        sampling=Sampling.from_obj(sampling) if sampling else None)


async def build_router(cfg: Section, tls, client):
    from .cache import open_log, open_store
    from .models import load_backend
    from .router import FrontDoor, RouterConfig, RouterService, frontdoor_ssl_context

    r = cfg.table("router")
    drafters = []
    for n, entry in enumerate(r.get("drafters", list)):
        d = Section(entry, f"{r.where}.drafters[{n}]")
        digest = d.get("model_digest", str, "")
        if not digest:
            digest = load_backend(d.get("model", str)).digest.hex()
        drafters.append((d.get("uri", str), bytes.fromhex(digest)))
    config = RouterConfig(
        uri=cfg.get("uri", str), verifiers=r.uris("verifiers"), drafters=tuple(drafters),
        m_init=r.get("m_init", int, 4), monitor_interval_s=r.get("monitor_interval_s", float, 0.1),
        stall_s=r.get("stall_s", float, 5.0), request_timeout_s=r.get("request_timeout_s", float, 5.0),
        target_kv=r.get("target_kv", bool, True), session_load=r.get("session_load", int, 5),
        contract=contract_defaults(r.table("contract")))
    backend = load_backend(cfg.get("model", str))
    store = await open_store(cfg.get("store", str))
    commit_log = await open_log(cfg.get("commit_log", str))
    service = RouterService(config, backend, store, commit_log, client=client)
    closers = [store.close, commit_log.close]
    frontdoor = r.get("frontdoor", str, "")
    if frontdoor:
        context = frontdoor_ssl_context(tls) if r.get("frontdoor_tls", bool, False) else None
        door = FrontDoor(service, host=host_port(frontdoor)[0], port=host_port(frontdoor)[1],
                         ssl_context=context)
        service.frontdoor = door
        await door.start()
        closers.insert(0, door.stop)
    return service, closers


BUILDERS = {"verifier": build_verifier, "drafter": build_drafter, "router": build_router}


# ---------------------------------------------------------------------- running


async def run(role: str, cfg: Section) -> int:
    from .transport import Client, TLSConfig, serve

    declared = cfg.get("role", str, role)
    if declared != role:
        raise ConfigError(f"{cfg.where} is a {declared} config, not a {role} one")
    uri = cfg.get("uri", str)
    tls = TLSConfig.for_instance(cfg.get("certs", str), uri)
    protocol = cfg.get("protocol", str, "h2")
    if protocol not in ("h2", "h3"):
        raise ConfigError(f"{cfg.where}.protocol: 'h2' or 'h3', not {protocol!r}")
    client = Client(tls, protocol, timeout=10.0)
    service, closers = await BUILDERS[role](cfg, tls, client)
    await service.start()
    host, port = listen_address(cfg)
    server = await serve(service, host=host, port=port, tls=tls, http3=cfg.get("http3", bool, True),
                         http2=cfg.get("http2", bool, True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = cfg.get("ready_file", str, "")
    if ready:
        info = {"uri": uri, "port": server.port, "pid": os.getpid()}
        door = getattr(service, "frontdoor", None)
        if door is not None:
            info["frontdoor_port"] = door.port
        tmp = Path(ready + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready)
    log.info("%s %s serving on %s:%d", role, uri, host, server.port)
    await stop.wait()
    log.info("%s %s stopping", role, uri)
    await server.stop(grace=1.0)
    await service.stop()
    for close in closers:
        try:
            await close()
        except Exception as exc:   # closing is best effort: the process ends anyway
            log.debug("close failed: %s", exc)
    await client.close()
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        level = cfg.get("log_level", str, "info").upper()
    except ConfigError as exc:
        print(f"sdcp-fast serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(args.role, cfg))
    except ConfigError as exc:
        print(f"sdcp-fast serve: {exc}", file=sys.stderr)
        return 2
