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
    log_level  = "info"                     # debug | info | warning | error
    log_format = "text"                     # or "json": one JSON object per line

Relative paths (certs, embedded store, file commit log, ready_file) are relative to the
working directory of the process (`sdcp-fast up DIR` runs each instance in its work dir).

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
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
LADDER = ("reduce", "switch", "self_decode", "fail")
ROLES = ("verifier", "drafter", "router")
SPECULATION_MODES = ("auto", "on", "off")   # [verifier] speculation (verifier/speculation.py)


class ConfigError(ValueError):
    """A config file with a missing member, one of the wrong type, or an unknown one."""


@dataclass(frozen=True)
class VerifierSection:
    routers: list[str]                      # identities that may open, assign, read output, set policy
    router_uri: str | None = None           # where events and status reports go
    router_uris: list[str] = field(default_factory=list)   # every router's base URI (several
                                            # routers share sessions): reports and events go to each
    output_wait_s: float = 5.0              # long-poll wait of GET output
    ttl_ms: int = 3000
    status_interval_s: float = 1.0          # below ttl_ms
    publish_kv_every: int = 0               # rounds between target KV publications (0: never)
    max_batch: int = 64                     # jobs per forward pass
    max_wait_ms: float = 2.0                # the first job's wait for company
    company_share: float = 0.5              # ... and up to this share of a batch's cost for sessions of the last two batches
    group_commit: bool = True               # a batch's commit records in one durable write (false: one each)
    speculation: str = "auto"               # auto: speculate while it commits more than self-decoding
                                            # (measured); on: always (the drafters' M under the load
                                            # rule); off: self-decode every session from its first token
    first_token: bool = True                # auto: a speculating session's first token from its
                                            # prefill (a self-decoded round), its drafter after it
    batch_log: str | None = None            # JSON line per verify batch (timelines, benchmarks)
    metrics: str = ""                       # host:port of GET /metrics and GET /health (empty: none)
    max_sessions: int = 4096
    session_memory_mb: int = 2048           # budget of all sessions' state, model KV included
    retire_idle_s: float = 30.0             # over budget, sessions idle this long may be retired
    max_context_tokens: int = 32768         # the longest session a memory reservation counts with
    idle_s: float = 1800.0                  # a session untouched this long is retired

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ConfigError(f"speculation: one of {', '.join(SPECULATION_MODES)}, not {self.speculation!r}")


@dataclass(frozen=True)
class DrafterSection:
    routers: list[str]                      # identities that may send assignments
    router_uri: str | None = None           # where status reports go
    router_uris: list[str] = field(default_factory=list)   # every router's base URI: status
                                            # reports go to each
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
    metrics: str = ""                       # host:port of GET /metrics and GET /health (empty: none)


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
    self_load: int | None = 60              # self_decode only at or below this verifier load
    self_max: int | None = None             # tokens per self-decoding period (absent: no limit,
                                            # so a poor draft never fails a request)
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
    served_model_name: str = ""             # the OpenAI API's model name (default: from the model spec)
    logprobs_mode: str = "raw_logprobs"     # the OpenAI API's log-probabilities: raw_logprobs (log-softmax
                                            # of the target's logits) or processed_logprobs (after temperature,
                                            # top-k, top-p); a request's logprobs_mode overrides
    metrics: str = ""                       # host:port of /metrics and /health besides the front door's
    m_init: int = 4
    stall_s: float = 5.0
    monitor_interval_s: float = 0.1
    request_timeout_s: float = 5.0
    open_timeout_s: float = 30.0            # bound of one session-open (a prefill, behind the batches)
    target_kv: bool = True                  # offer the verifier's published target KV on resume
    session_load: int = 5
    session_table: str = ""                 # where sessions are recorded (file:DIR, redis://..., etcd://...);
                                            # empty: beside the commit log. Routers sharing one share sessions
    lease_ttl_s: float = 5.0                # a router silent this long loses its sessions to another
    status_grace_s: float = 3.0             # after start, an instance not heard from yet is not taken for dead
    itl_target_ms: float = 0.0              # inter-token latency objective: admission lets in as many generations
                                            # as keep the median under it (0: no target, max_running run)
    max_running: int = 256                  # generations running at once, at most; more wait in the queue
    max_waiting: int = 1024                 # generations the admission queue holds; more get 503 + Retry-After
    admission_interval_s: float = 1.0       # how often admission adjusts to the measured latency
    contract: ContractSection = field(default_factory=ContractSection)


@dataclass(frozen=True)
class InstanceConfig:
    uri: str                                # base URI; the URI SAN of the instance's certificate
    certs: str                              # directory of ca.pem + <name>.pem/.key (`sdcp-fast certs`)
    model: str                              # tiny:NAME|PATH, table:PATH or hf:PATH
    store: str                              # object store: embedded:PATH or redis://HOST:PORT/0
    role: str = ""                          # verifier | drafter | router (must match `serve ROLE`)
    listen: str = ""                        # host:port to bind (default: the URI's host and port)
    protocol: str = "h2"                    # how this instance calls its peers: h2 or h3
    http2: bool = True                      # serve HTTP/2 (TCP)
    http3: bool = True                      # also serve HTTP/3 on the same port (UDP)
    commit_log: str = ""                    # verifier and router: file:PATH, redis://..., etcd://...
    ready_file: str = ""                    # JSON {"uri", "port", "pid", ...} written once serving
    log_level: str = "info"                 # debug | info | warning | error
    log_format: str = "text"                # text, or json (one object per line)
    verifier: VerifierSection | None = None
    drafter: DrafterSection | None = None
    router: RouterSection | None = None
    transport: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol: 'h2' or 'h3', not {self.protocol!r}")
        if self.role and self.role not in ROLES:
            raise ConfigError(f"role: one of {', '.join(ROLES)}, not {self.role!r}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level: one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format: 'text' or 'json', not {self.log_format!r}")

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


# ---------------------------------------------------------------------- reference


SECTIONS = {"verifier": VerifierSection, "drafter": DrafterSection, "router": RouterSection}


def members(cls: type) -> list[tuple[str, str, str]]:
    """(name, "type = default", comment) of each member of a schema dataclass; the comment
    is the one written beside the field in this file (one source for code and help)."""
    import inspect
    import re

    comments: dict[str, str] = {}
    pending = None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^#]+?(?:#\s*(.*))?$", line)
        if m:
            pending = m.group(1)
            comments[pending] = m.group(2) or ""
        elif pending and (c := re.match(r"\s+#\s*(.*)$", line)):
            comments[pending] += " " + c.group(1)     # a comment continued on the next line
        else:
            pending = None
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        kind = str(hint) if typing.get_origin(hint) else hint.__name__
        kind = kind.replace("sdcp_fast.config.", "")
        if f.default is not dataclasses.MISSING:
            default = "(absent)" if f.default is None else repr(f.default).replace("'", '"')
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            default = "[...]" if dataclasses.is_dataclass(value) else repr(value).replace("'", '"')
        else:
            default = "(required)"
        out.append((f.name, f"{kind} = {default}", comments.get(f.name, "")))
    return out


def reference(role: str | None = None) -> str:
    """The members of an instance's file (those of every role, then the role's table)."""
    def table(cls, title: str) -> list[str]:
        lines = [title]
        for name, kind, comment in members(cls):
            if cls is InstanceConfig and (name in SECTIONS or name == "transport"):
                continue
            lines.append(f"  {name:<20} {kind:<34} {comment}".rstrip())
        return lines
    lines = table(InstanceConfig, "members of every instance (top level):")
    for name, cls in SECTIONS.items():
        if role in (None, name):
            lines += ["", *table(cls, f"[{name}]:")]
            if cls is RouterSection:
                lines += ["", *table(DrafterEntry, "[[router.drafters]]:"), "",
                          *table(ContractSection, "[router.contract]:")]
    lines += ["", *table(Limits, "[transport] (every role; limits against hostile clients, docs/TRANSPORT.md):")]
    return "\n".join(lines)


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
