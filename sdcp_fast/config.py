"""One TOML file per instance: the schema `sdcp-fast serve` reads and `procs.Cluster` writes.

Each table is a frozen dataclass below: its fields are the members, with their types and
defaults. `load(path)` parses and checks a file (a wrong type, a missing member, or a
member the schema does not know is a `ConfigError` naming it, with the closest known name);
`dumps(config)` writes one with tomli-w. Members common to every role:

    role       = "verifier"                 # optional: must match `sdcp-fast serve ROLE`
    uri        = "https://127.0.0.1:9201/"  # base URI; the URI SAN of the instance's certificate
    listen     = "127.0.0.1:9201"           # host:port to bind (default: the URI's host and port)
    certs      = "/path/certs"              # ca.pem + <name>.pem/.key (`sdcp-fast certs`)
    protocol   = "h2"                       # how this instance calls its peers: "h2" or "h3"
    http2      = true                       # serve HTTP/2 (TCP)
    http3      = true                       # also serve HTTP/3 on the same port (UDP)
    model      = "tiny:demo-target"         # verifier: target; drafter: draft; router: target
                                            # (the router uses its tokenizer and digests)
    store      = "embedded:/dev/shm/x"      # object store (cache references)
    commit_log = "file:/var/lib/sdcp/log"   # verifier and router
    ready_file = "/tmp/v1.ready"            # optional: JSON {"uri", "port", "pid"} once serving
    log_level  = "info"

one table for the role: [verifier], [drafter] or [router] (see the dataclasses), and an
optional [transport] table: the limits the instance's HTTP/2 and HTTP/3 server holds hostile
clients to (`transport.limits.Limits`; every member has a default), e.g.

    [transport]
    max_connections_per_client = 16
    idle_timeout = 300.0
    body_limits = { proposals = 65536 }
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from .transport.limits import Limits

PROTOCOLS = ("h2", "h3")
LADDER = ("reduce", "switch", "self_decode", "fail")
ROLES = ("verifier", "drafter", "router")


class ConfigError(ValueError):
    """A config file with a missing member, one of the wrong type, or an unknown one."""


@dataclass(frozen=True)
class VerifierSection:
    routers: list[str]                      # identities that may open, assign, read output, set policy
    router_uri: str | None = None           # where events and status reports go
    output_wait_s: float = 5.0              # long-poll wait of GET output
    ttl_ms: int = 3000
    status_interval_s: float = 1.0          # below ttl_ms
    publish_kv_every: int = 0               # rounds between target KV publications (0: never)
    max_batch: int = 64                     # jobs per forward pass
    max_wait_ms: float = 2.0                # the first job's wait for company
    metrics: str = ""                       # host:port of the Prometheus page (empty: none)
    max_sessions: int = 4096
    session_memory_mb: int = 2048           # budget of all sessions' state, model KV included
    retire_idle_s: float = 30.0             # over budget, sessions idle this long may be retired
    max_context_tokens: int = 32768         # the longest session a memory reservation counts with
    idle_s: float = 1800.0                  # a session untouched this long is retired


@dataclass(frozen=True)
class DrafterSection:
    routers: list[str]                      # identities that may send assignments
    router_uri: str | None = None           # where status reports go
    ttl_ms: int = 2000
    status_interval_s: float = 0.5
    max_sessions: int = 64
    session_memory_mb: int = 1024           # budget of all sessions' state, draft KV included
    max_context_tokens: int = 32768         # the longest session a memory reservation counts with
    max_batch: int = 32                     # sessions per draft step
    request_timeout_s: float = 5.0
    give_up_after_s: float = 10.0           # no verdict for this long: stop
    max_q_republish: int = 3
    publish_draft_kv: bool = True
    draft_kv_every: int = 8
    draft_ahead: bool = True
    rounds_log: str | None = None           # JSON line per verdict (demo statistics, tests)
    drop_verdicts: int = 0                  # test hook: discard the first N verdicts


@dataclass(frozen=True)
class DrafterEntry:
    uri: str
    model: str = ""                         # the drafter's model spec (its digest is computed) ...
    model_digest: str = ""                  # ... or the digest itself, hex


@dataclass(frozen=True)
class ContractSection:
    """Contract members a generation request may leave out."""

    rule: int = 1
    m_max: int = 8
    max_new: int = 128
    stop: list[int] = field(default_factory=list)
    low_rounds: int = 4
    low_ratio: int | None = None
    fallback: list[str] = field(default_factory=lambda: ["reduce", "switch", "self_decode"])
    self_load: int | None = 60
    self_max: int | None = 16
    sampling: dict[str, int] = field(default_factory=dict)   # temperature_milli, top_k, top_p_milli, seed

    def __post_init__(self) -> None:
        unknown = [n for n in self.fallback if n not in LADDER]
        if unknown:
            raise ConfigError(f"fallback: unknown actions {unknown} ({', '.join(LADDER)})")


@dataclass(frozen=True)
class RouterSection:
    verifiers: list[str]
    drafters: list[DrafterEntry]
    frontdoor: str = ""                     # host:port of the client front door (empty: none)
    frontdoor_tls: bool = False             # TLS 1.3 with client certificates of the deployment's CA
    m_init: int = 4
    stall_s: float = 5.0
    monitor_interval_s: float = 0.1
    request_timeout_s: float = 5.0
    target_kv: bool = True                  # offer the verifier's published target KV on resume
    session_load: int = 5
    contract: ContractSection = field(default_factory=ContractSection)


@dataclass(frozen=True)
class InstanceConfig:
    uri: str
    certs: str
    model: str
    store: str
    role: str = ""
    listen: str = ""
    protocol: str = "h2"
    http2: bool = True
    http3: bool = True
    commit_log: str = ""
    ready_file: str = ""
    log_level: str = "info"
    verifier: VerifierSection | None = None
    drafter: DrafterSection | None = None
    router: RouterSection | None = None
    transport: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol: 'h2' or 'h3', not {self.protocol!r}")
        if self.role and self.role not in ROLES:
            raise ConfigError(f"role: one of {', '.join(ROLES)}, not {self.role!r}")

    def section(self, role: str):
        """The role's table; a ConfigError when the file has none."""
        value = getattr(self, role)
        if value is None:
            raise ConfigError(f"missing the [{role}] table")
        return value


# ---------------------------------------------------------------------- reading


def load(path: str | Path, role: str | None = None) -> InstanceConfig:
    """The file's config; with `role`, a file written for another role is refused first."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    declared = data.get("role")
    if role is not None and declared not in (None, "", role):
        raise ConfigError(f"{path.name} is a {declared} config, not a {role} one")
    return parse(data, path.name)


def loads(text: str, where: str = "config") -> InstanceConfig:
    return parse(tomllib.loads(text), where)


def parse(data: dict[str, Any], where: str) -> InstanceConfig:
    return from_table(InstanceConfig, data, where)


def from_table(cls: type, data: dict[str, Any], where: str):
    """A dataclass of the schema from one TOML table, every member checked."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}: unknown member {unknown[0]!r}{hint}")
    values = {}
    for name, f in known.items():
        if name in data:
            values[name] = _value(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing {name!r}")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc}") from None


def _value(kind, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):          # X | None: TOML has no null
        return _value(next(a for a in args if a is not type(None)), value, where)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table")
        return from_table(kind, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return [_value(args[0], v, f"{where}[{n}]") for n, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        return {k: _value(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------- writing


def to_table(config) -> dict[str, Any]:
    """The TOML table of a schema dataclass (members left at None are left out)."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value
    return clean(dataclasses.asdict(config))


def dumps(config: InstanceConfig) -> str:
    return tomli_w.dumps(to_table(config))
