"""Every SDCP message of draft section 5.2, the contract and the sampling profile.

Each message is a frozen dataclass that validates on construction (ranges and sizes of the
CDDL), decodes from untrusted CBOR with `from_cbor` and encodes deterministically with
`to_cbor`. One declarative table of members per class drives both directions, so a CDDL
rule is written once.

Unknown map keys are ignored, except in the contract and its sampling map, where they are
refused (sdcp-bad-contract), so that every party digests the same content. An unknown
action value decodes as fail. Sequences are held as tuples. Absent optional members are
None and are omitted on encoding, which keeps a contract's digest over exactly the members
it was created with.

One extension member (section 5.2 lets receivers ignore unknown keys): `router_epoch` on
session-open, assignment and policy, the sending router's ownership epoch of the session
(docs/ARCHITECTURE.md, "Routers: ownership"). A receiver that knows it keeps the highest
one seen per session and refuses lower ones, so that a router that lost a session cannot
act for it late; one that does not know it ignores it.

Two more extension members carry the target's log-probabilities (the OpenAI door's
`logprobs`), never in the contract (they would change its digest): session-open's
`logprobs` (`LogprobsAsk`: how many alternatives per token, raw or processed scores) asks
the verifier to keep them for the session's committed tokens, and output's `logprobs`
(`TokenLogprobs`) carries them for exactly the message's tokens. session-open's
`prefill_share` says how many sessions open with the same prompt together (one prefill
serves them all). A receiver that does not know them ignores them.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, TypeVar

from . import cbor
from .digest import UINT32_MAX, contract_digest_of_encoding
from .problems import Kind, Problem, ProblemError

UINT64_MAX = (1 << 64) - 1
MAX_TOP_LOGPROBS = 20   # alternatives per token a session may ask for (OpenAI's and vLLM's bound)


class Action(enum.IntEnum):
    CONTINUE = 0
    REDUCE = 1
    SWITCH = 2
    SELF_DECODE = 3
    FINISH = 4
    FAIL = 5

    @classmethod
    def lenient(cls, value: int) -> Action:
        """A received action: any value this code does not know means fail (section 5.2)."""
        return cls._value2member_map_.get(value, cls.FAIL)


LADDER_ACTIONS = frozenset({Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FAIL})
RULE_GREEDY = 1
RULE_SPECULATIVE = 2
REGISTERED_RULES = frozenset({RULE_GREEDY, RULE_SPECULATIVE})
ROLE_DRAFTER = 1
ROLE_VERIFIER = 2


class MessageError(ProblemError):
    """A message that breaks its CDDL: 400, or 422 sdcp-bad-contract inside a contract."""

    def __init__(self, detail: str, kind: Kind = Kind.BAD_REQUEST):
        super().__init__(Problem(kind, detail))


# --------------------------------------------------------------------------- member checks
# A check takes (value, where) and returns the value normalised (lists -> tuples), or raises
# ValueError with the reason; the caller adds the member's name and the problem kind.

Check = Callable[[Any], Any]


def uint(*, le: int = UINT64_MAX, ge: int = 0) -> Check:
    def check(v: Any) -> int:
        if type(v) is not int and not isinstance(v, enum.IntEnum):
            raise ValueError(f"expected an unsigned integer, got {type(v).__name__}")
        if not ge <= v <= le:
            raise ValueError(f"{v} is outside {ge}..{le}")
        return v if type(v) is int else int(v)
    check.bounds = (ge, le)   # lets `array` check a list of plain ints in one pass
    check.kind = ("uint", ge, le)   # lets a class's compiled checker test it inline (_compile_checker)
    return check


def bstr(size: int | None = None) -> Check:
    def check(v: Any) -> bytes:
        if not isinstance(v, bytes | bytearray):
            raise ValueError(f"expected a byte string, got {type(v).__name__}")
        if size is not None and len(v) != size:
            raise ValueError(f"expected {size} bytes, got {len(v)}")
        return bytes(v)
    check.kind = ("bstr", size)
    return check


def tstr(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a text string, got {type(v).__name__}")
    return v


tstr.kind = ("tstr",)


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected a boolean, got {type(v).__name__}")
    return v


def array(item: Check, *, nonempty: bool = False) -> Check:
    bounds = getattr(item, "bounds", None)

    def check(v: Any) -> tuple:
        if type(v) is not tuple and not isinstance(v, list | tuple):
            raise ValueError(f"expected an array, got {type(v).__name__}")
        if nonempty and not v:
            raise ValueError("expected at least one element")
        # a token list, the bulk of every large message: plain ints in range pass in one
        # sweep; anything else (and every error message) goes item by item below
        if bounds is not None and v and all(type(x) is int for x in v) and \
                bounds[0] <= min(v) and max(v) <= bounds[1]:
            return tuple(v)
        out = []
        for n, x in enumerate(v):
            try:
                out.append(item(x))
            except ValueError as exc:
                raise ValueError(f"[{n}]: {exc}") from None
        return tuple(out)
    if bounds is not None:
        check.kind = ("uints", bounds[0], bounds[1], nonempty)
    return check


def either(*checks: Check) -> Check:
    def check(v: Any) -> Any:
        reasons = []
        for c in checks:
            try:
                return c(v)
            except ValueError as exc:
                reasons.append(str(exc))
        raise ValueError(" / ".join(reasons))
    return check


def action(*, strict: bool) -> Check:
    """Actions we emit are checked strictly; actions we receive are read leniently."""
    base = uint()

    def check(v: Any) -> Action:
        v = base(v)
        return Action(v) if strict else Action.lenient(v)
    check.kind = ("action",)
    return check


def nested(cls: type[Message], *, lenient: bool = False) -> Check:
    """A nested map. `lenient`: a closed type (the sampling profile) used outside the
    contract, where section 5.2 says unknown keys are ignored and a bad value is a plain 400."""
    def check(v: Any) -> Message:
        if isinstance(v, cls):
            return v
        if not isinstance(v, Mapping):
            raise ValueError(f"expected a map, got {type(v).__name__}")
        if not lenient:
            return cls.from_obj(v)
        try:
            return cls.from_obj({k: x for k, x in v.items() if k in cls.members})
        except ProblemError as exc:
            raise ValueError(exc.problem.detail) from None
    check.kind = ("nested", cls, lenient)
    return check


token = uint(le=UINT32_MAX)  # tokens are digested as uint32 (section 4.2)
tokens = array(token)
hash32 = bstr(32)
session_id = bstr(16)
cache_ref = tstr


# --------------------------------------------------------------------------- base class

M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class Message:
    """Base: `members` maps attribute -> (check, optional); keys equal attribute names."""

    members: ClassVar[dict[str, tuple[Check, bool]]] = {}
    closed: ClassVar[bool] = False        # refuse unknown keys (contract, sampling)
    problem_kind: ClassVar[Kind] = Kind.BAD_REQUEST
    # CBOR data items one encoded message may hold: decoding stops at the first item past
    # it, so a body full of tiny items costs what a real message does. Messages with a token
    # list of unbounded length (an inline prompt, output) take the decoder's default.
    max_items: ClassVar[int] = 1024

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # each class gets its own checker and encoder, compiled at its first use (once the
        # dataclass decorator has run): see _compile_checker and _compile_encoder
        if "__post_init__" not in cls.__dict__:
            cls.__post_init__ = _first_check
        if "_encode_into" not in cls.__dict__:
            cls._encode_into = _first_encode

    def __post_init__(self) -> None:
        """Every member checked in `members` order, then `validate` (the generic path: each
        class runs its compiled twin, `_compile_checker`, which gives the same answers)."""
        for name in self.members:
            self._check_member(name)
        self.validate()

    def _check_member(self, name: str) -> None:
        """One member: None where optional, else its check; a normalised value (a list made
        a tuple) is stored. Raises the MessageError naming the member."""
        check, optional = self.members[name]
        value = getattr(self, name)
        if value is None:
            if not optional:
                raise MessageError(f"{self._name()}.{name} is required", self.problem_kind)
            return
        try:
            checked = check(value)
        except ValueError as exc:
            raise MessageError(f"{self._name()}.{name}: {exc}", self.problem_kind) from None
        if checked is not value:   # normalised (a list made a tuple): most values pass as they are
            object.__setattr__(self, name, checked)

    def validate(self) -> None:
        """Cross-member rules beyond the CDDL; subclasses override."""

    @classmethod
    def _name(cls) -> str:
        return cls.__name__.lower()

    @classmethod
    def from_obj(cls: type[M], obj: Mapping[Any, Any]) -> M:
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise MessageError(f"{cls._name()} must be a map", cls.problem_kind)
        if cls.closed:
            unknown = [k for k in obj if k not in cls.members]
            if unknown:
                shown = sorted(str(k)[:40] for k in unknown[:8])   # bounded: keys are untrusted
                more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
                raise MessageError(f"{cls._name()} has unknown keys {shown}{more}", cls.problem_kind)
        values = dict(zip(cls.members, map(obj.get, cls.members), strict=True))   # {n: obj.get(n)}: no call per member
        direct = cls.__dict__.get("_direct_init")
        if direct is None:
            # the dataclass __init__ only stores each field (one object.__setattr__ call per
            # member of a frozen class) before __post_init__ checks them all: where a class's
            # fields are exactly its members, decoding stores them at once, then checks the same
            direct = cls._direct_init = {f.name for f in dataclasses.fields(cls)} == set(cls.members)
        if not direct:
            return cls(**values)
        message = object.__new__(cls)
        message.__dict__.update(values)
        message.__post_init__()
        return message

    @classmethod
    def from_cbor(cls: type[M], data: bytes, *, max_size: int = cbor.DEFAULT_MAX_SIZE) -> M:
        try:
            obj = cbor.loads(data, max_size=max_size, max_items=cls.max_items)
        except cbor.TooLarge as exc:
            raise MessageError(str(exc), Kind.TOO_LARGE) from None
        except cbor.DecodeError as exc:
            raise MessageError(f"malformed CBOR: {exc}") from None
        return cls.from_obj(obj)

    def to_obj(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.members:
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = _plain(value)
        return out

    def to_cbor(self) -> bytes:
        out: list[bytes] = []
        self._encode_into(out)
        return b"".join(out)

    def _encode_into(self, out: list[bytes]) -> None:
        """The bytes of `cbor.dumps(self.to_obj())`, without building the dict and sorting
        its encoded pairs each time: a class's members, ordered by their encoded keys (the
        deterministic map order), are worked out once. A class with its own `to_obj` takes
        the general path. (Each class runs its compiled twin, `_compile_encoder`.)"""
        cls = type(self)
        if cls.to_obj is not Message.to_obj:
            cbor.encode_into(self.to_obj(), out)
            return
        order = cls.__dict__.get("_cbor_order")
        if order is None:
            order = sorted((cbor.key_bytes(name), name) for name in cls.members)
            cls._cbor_order = order
        present = [(key, value) for key, name in order if (value := getattr(self, name)) is not None]
        out.append(cbor.head(5, len(present)))
        for key, value in present:
            out.append(key)
            if isinstance(value, Message):
                value._encode_into(out)
            else:
                cbor.encode_into(_plain(value), out)

    def replace(self: M, **changes: Any) -> M:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- compiled twins
# A message's checks and its encoding are the bulk of what a verifier does per proposal in
# Python beside the transport: the generic loops above make a call per member (a check, a
# getattr, an encode), ~30 per message. Each class compiles, at its first use, one function
# for each that tests a member's usual case inline (an int in range, bytes of the right
# size, a tuple of ints in range, a message of the right class) and hands anything else to
# the generic code for that member: same order, same normalisation, same refusals and
# messages (tests/core/test_messages.py compares both on valid and broken input).

_INT_ONLY = frozenset({int})


def _member_kinds(cls: type[Message]) -> dict[str, tuple] | None:
    """member -> its check's kind, or None when the class cannot take the compiled path
    (its fields are not exactly its members)."""
    if {f.name for f in dataclasses.fields(cls)} != set(cls.members):
        return None
    return {name: getattr(check, "kind", ("other",)) for name, (check, _) in cls.members.items()}


def _compile_checker(cls: type[Message]) -> Callable[[Message], None]:
    kinds = _member_kinds(cls)
    if kinds is None:
        return Message.__post_init__
    env: dict[str, Any] = {"_INT_ONLY": _INT_ONLY, "Action": Action, "_min": min, "_max": max,
                           "_set": set, "_map": map, "_tuple": tuple, "_type": type, "_len": len,
                           "_bytes": bytes, "_int": int, "_str": str, "_list": list, "_dict": dict,
                           "_setitem": _setitem}
    lines = ["def __post_init__(self):", "    d = self.__dict__", "    slow = self._check_member"]
    for n, (name, (_, optional)) in enumerate(cls.members.items()):
        kind = kinds[name]
        lines.append(f"    v = d[{name!r}]")
        if kind[0] == "uint":
            ok = f"_type(v) is _int and {kind[1]} <= v <= {kind[2]}"
        elif kind[0] == "bstr":
            ok = "_type(v) is _bytes" + (f" and _len(v) == {kind[1]}" if kind[1] is not None else "")
        elif kind[0] == "tstr":
            ok = "_type(v) is _str"
        elif kind[0] == "action":
            ok = "_type(v) is Action"
        elif kind[0] == "nested":
            env[f"_cls{n}"] = kind[1]
            ok = f"_type(v) is _cls{n}"
            if not kind[2]:   # a decoded map: what the generic check does with it, at once
                ok = f"{ok} or (_type(v) is _dict and _setitem(d, {name!r}, _cls{n}.from_obj(v)))"
        elif kind[0] == "uints":
            _, ge, le, nonempty = kind
            values_ok = f"_set(_map(_type, v)) == _INT_ONLY and {ge} <= _min(v) and _max(v) <= {le}"
            ok = "(_type(v) is _tuple or _type(v) is _list) and " + \
                 (f"v and {values_ok}" if nonempty else f"(not v or {values_ok})")
        else:
            ok = "False"
        if optional:
            ok = f"v is None or ({ok})"
        lines.append(f"    if not ({ok}):")
        lines.append(f"        slow({name!r})")
        if kind[0] == "uints":   # a list (as decoded) is held as a tuple
            lines.append("    elif _type(v) is _list:")
            lines.append(f"        d[{name!r}] = _tuple(v)")
    if cls.validate is not Message.validate:
        lines.append("    self.validate()")
    exec("\n".join(lines), env)   # noqa: S102 (our own source, built from the class's table)
    return env["__post_init__"]


def _setitem(d: dict, name: str, value: Any) -> bool:
    d[name] = value
    return True


def _first_check(self: Message) -> None:
    cls = type(self)
    checker = _compile_checker(cls)
    cls.__post_init__ = checker
    checker(self)


def _compile_encoder(cls: type[Message]) -> Callable[[Message, list[bytes]], None]:
    kinds = _member_kinds(cls)
    if kinds is None or cls.to_obj is not Message.to_obj:
        return Message._encode_into
    order = sorted((cbor.key_bytes(name), name) for name in cls.members)
    env: dict[str, Any] = {"_head": cbor.head, "_uints": cbor.uint_array, "_encode": cbor.encode_into,
                           "_S0": cbor.small_heads(0), "_S2": cbor.small_heads(2), "_S3": cbor.small_heads(3),
                           "_plain": _plain, "_len": len, "Message": Message, "isinstance": isinstance}
    lines = ["def _encode_into(self, out):", "    d = self.__dict__"]
    required = sum(1 for name in cls.members if not cls.members[name][1])
    optional = [name for name in cls.members if cls.members[name][1]]
    count = " + ".join([str(required), *(f"(d[{name!r}] is not None)" for name in optional)])
    lines.append(f"    out.append(_head(5, {count}))" if optional else f"    out.append({cbor.head(5, required)!r})")
    for n, (key, name) in enumerate(order):
        kind = kinds[name]
        env[f"_k{n}"] = key
        pad = "    "
        lines.append(f"{pad}v = d[{name!r}]")
        if cls.members[name][1]:
            lines.append(f"{pad}if v is not None:")
            pad += "    "
        lines.append(f"{pad}out.append(_k{n})")
        if kind[0] in ("uint", "action"):   # checked: an int (an Action for actions) in range
            lines.append(f"{pad}out.append(_S0[v] if v < 24 else _head(0, v))")
        elif kind[0] == "bstr" and kind[1] is not None:   # checked: exactly that many bytes
            lines.append(f"{pad}out.append({cbor.head(2, kind[1])!r})")
            lines.append(f"{pad}out.append(v)")
        elif kind[0] == "bstr":
            lines.append(f"{pad}n = _len(v)")
            lines.append(f"{pad}out.append(_S2[n] if n < 24 else _head(2, n))")
            lines.append(f"{pad}out.append(v)")
        elif kind[0] == "uints":
            lines.append(f"{pad}out.append(_uints(v))")
        elif kind[0] == "tstr":
            lines.append(f"{pad}b = v.encode('utf-8')")
            lines.append(f"{pad}n = _len(b)")
            lines.append(f"{pad}out.append(_S3[n] if n < 24 else _head(3, n))")
            lines.append(f"{pad}out.append(b)")
        elif kind[0] == "nested":
            lines.append(f"{pad}v._encode_into(out)")
        else:   # as the generic path does it
            lines.append(f"{pad}if isinstance(v, Message):")
            lines.append(f"{pad}    v._encode_into(out)")
            lines.append(f"{pad}else:")
            lines.append(f"{pad}    _encode(_plain(v), out)")
    exec("\n".join(lines), env)   # noqa: S102 (our own source, built from the class's table)
    return env["_encode_into"]


def _first_encode(self: Message, out: list[bytes]) -> None:
    cls = type(self)
    encoder = _compile_encoder(cls)
    cls._encode_into = encoder
    encoder(self, out)


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind is int or kind is bytes or kind is str:   # most members: nothing to convert
        return value
    if kind is tuple:   # token lists: plain ints pass as they are
        return [v if type(v) is int else _plain(v) for v in value]
    if isinstance(value, Message):
        return value.to_obj()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.IntEnum):
        return int(value)
    return value


# --------------------------------------------------------------------------- contract types


@dataclass(frozen=True)
class Sampling(Message):
    temperature_milli: int | None = None
    top_k: int | None = None
    top_p_milli: int | None = None
    seed: int | None = None

    members: ClassVar = {
        "temperature_milli": (uint(), True),
        "top_k": (uint(), True),
        "top_p_milli": (uint(le=1000), True),
        "seed": (uint(), True),
    }
    closed: ClassVar = True
    problem_kind: ClassVar = Kind.BAD_CONTRACT

    def transform(self) -> dict[str, int]:
        """The members that shape p from logits (all but the seed), as keyword arguments of
        `kernels.target_probs` and `kernels.ProposalInput.sampling`; absent members are
        left out, so the kernels apply their defaults (../shared/spec/NOTES.md)."""
        return {k: v for k, v in (("temperature_milli", self.temperature_milli), ("top_k", self.top_k),
                                  ("top_p_milli", self.top_p_milli)) if v is not None}


def transform_of(sampling: Sampling | None) -> dict[str, int]:
    """`Sampling.transform` of a profile that may be absent (no profile: the defaults)."""
    return {} if sampling is None else sampling.transform()


@dataclass(frozen=True)
class Contract(Message):
    target: bytes
    tokenizer: bytes
    rule: int
    m_max: int
    max_new: int
    stop: tuple[int, ...]
    low_rounds: int
    fallback: tuple[Action, ...]
    drafters: tuple[bytes, ...] | None = None
    sampling: Sampling | None = None
    low_ratio: int | None = None
    self_load: int | None = None
    self_max: int | None = None
    scope: bytes | None = None

    members: ClassVar = {
        "target": (hash32, False),
        "tokenizer": (hash32, False),
        "drafters": (array(hash32, nonempty=True), True),
        "rule": (uint(), False),
        "sampling": (nested(Sampling), True),
        "m_max": (uint(le=64, ge=1), False),
        "max_new": (uint(), False),
        "stop": (tokens, False),
        "low_rounds": (uint(ge=1), False),
        "low_ratio": (uint(le=100), True),
        "fallback": (array(action(strict=True), nonempty=True), False),
        "self_load": (uint(le=100), True),
        "self_max": (uint(), True),
        "scope": (bstr(16), True),
    }
    closed: ClassVar = True
    problem_kind: ClassVar = Kind.BAD_CONTRACT

    def validate(self) -> None:
        if self.rule not in REGISTERED_RULES:
            raise MessageError(f"contract.rule {self.rule} is not registered", Kind.BAD_CONTRACT)
        bad = [a for a in self.fallback if a not in LADDER_ACTIONS]
        if bad:
            raise MessageError(f"contract.fallback may hold only reduce, switch, self_decode and "
                               f"fail, not {[int(a) for a in bad]}", Kind.BAD_CONTRACT)

    @cached_property
    def cbor(self) -> bytes:
        return self.to_cbor()

    @cached_property
    def digest(self) -> bytes:
        """SHA-256("SDCP-CONTRACT-1" || 0x00 || deterministic_cbor(contract))."""
        return contract_digest_of_encoding(self.cbor)

    @property
    def low_ratio_or_default(self) -> int:
        return self.low_ratio or 0


@dataclass(frozen=True)
class Resume(Message):
    round: int
    committed: int
    digest: bytes
    committed_tokens: str
    target_kv: str | None = None

    members: ClassVar = {
        "round": (uint(le=UINT32_MAX), False),
        "committed": (uint(), False),
        "digest": (hash32, False),
        "committed_tokens": (cache_ref, False),
        "target_kv": (cache_ref, True),
    }


prompt_check = either(tokens, cache_ref)


@dataclass(frozen=True)
class LogprobsAsk(Message):
    """Extension (session-open member `logprobs`): keep the target's log-probabilities of
    every committed token and the `top` most probable alternatives at its position, as the
    verifier scored them. `processed`: of p after the sampling profile's temperature, top-k
    and top-p (the distribution the acceptance rule uses); absent or false: the raw
    log-softmax of the logits (what vLLM's V1 server reports by default)."""

    top: int = 0
    processed: bool | None = None

    members: ClassVar = {
        "top": (uint(le=MAX_TOP_LOGPROBS), False),
        "processed": (boolean, True),
    }


@dataclass(frozen=True)
class TokenLogprobs(Message):
    """Extension (output member `logprobs`): the target's log-probabilities for each token
    of the output message, in order. `token`: n IEEE 754 binary64 values (little-endian),
    log p of each token; `ids` and `values`: for each token its `top` alternatives, most
    probable first, as n x top uint32 (little-endian) ids and n x top binary64 values. A
    value of -inf (a token the processed distribution excludes) is carried as such."""

    top: int
    token: bytes
    ids: bytes
    values: bytes

    members: ClassVar = {
        "top": (uint(le=MAX_TOP_LOGPROBS), False),
        "token": (bstr(), False),
        "ids": (bstr(), False),
        "values": (bstr(), False),
    }

    def validate(self) -> None:
        n, rest = divmod(len(self.token), 8)
        if rest or len(self.ids) != 4 * n * self.top or len(self.values) != 8 * n * self.top:
            raise MessageError("logprobs: token, ids and values must hold n, n x top and n x top values")

    @property
    def count(self) -> int:
        return len(self.token) // 8

    @classmethod
    def pack(cls, top: int, entries) -> TokenLogprobs:
        """From [(log p, [(id, log p), ... top of them])] per token."""
        n = len(entries)
        ids = [i for _, alts in entries for i, _ in alts]
        values = [v for _, alts in entries for _, v in alts]
        if len(ids) != n * top:
            raise ValueError(f"every token needs {top} alternatives")
        return cls(top, struct.pack(f"<{n}d", *(lp for lp, _ in entries)),
                   struct.pack(f"<{len(ids)}I", *ids), struct.pack(f"<{len(values)}d", *values))

    def entries(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """[(log p, [(id, log p), ...])] per token: what `pack` took."""
        n, top = self.count, self.top
        lps = struct.unpack(f"<{n}d", self.token)
        ids = struct.unpack(f"<{n * top}I", self.ids)
        values = struct.unpack(f"<{n * top}d", self.values)
        return [(lps[k], list(zip(ids[k * top:(k + 1) * top], values[k * top:(k + 1) * top], strict=True)))
                for k in range(n)]


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class SessionOpen(Message):
    session: bytes
    epoch: int
    contract: Contract
    prompt: tuple[int, ...] | str
    commit_log: str
    prompt_kv: str | None = None
    resume: Resume | None = None
    router_epoch: int | None = None       # extension: the sending router's ownership epoch
    logprobs: LogprobsAsk | None = None   # extension: keep the target's log-probabilities
    prefill_share: int | None = None      # extension: sessions opening with this prompt together

    max_items: ClassVar[int] = cbor.DEFAULT_MAX_ITEMS   # an inline token list
    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "contract": (nested(Contract), False),
        "prompt": (prompt_check, False),
        "prompt_kv": (cache_ref, True),
        "commit_log": (cache_ref, False),
        "resume": (nested(Resume), True),
        "router_epoch": (uint(), True),
        "logprobs": (nested(LogprobsAsk, lenient=True), True),
        "prefill_share": (uint(le=1024), True),
    }


@dataclass(frozen=True)
class SessionState(Message):
    session: bytes
    epoch: int
    round: int
    committed: int
    digest: bytes
    state: int | None = None

    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "round": (uint(le=UINT32_MAX), False),
        "committed": (uint(), False),
        "digest": (hash32, False),
        "state": (uint(), True),
    }


@dataclass(frozen=True)
class Assignment(Message):
    session: bytes
    epoch: int
    contract: Contract
    verifier: str
    drafter: str
    prompt: tuple[int, ...] | str
    round: int
    committed: int
    digest: bytes
    m_init: int
    sampling: Sampling | None = None
    committed_tokens: str | None = None
    router_epoch: int | None = None       # extension: the sending router's ownership epoch

    max_items: ClassVar[int] = cbor.DEFAULT_MAX_ITEMS   # an inline token list
    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "contract": (nested(Contract), False),
        "verifier": (tstr, False),
        "drafter": (tstr, False),
        "prompt": (prompt_check, False),
        "round": (uint(le=UINT32_MAX), False),
        "sampling": (nested(Sampling, lenient=True), True),
        "committed": (uint(), False),
        "digest": (hash32, False),
        "committed_tokens": (cache_ref, True),
        "m_init": (uint(), False),
        "router_epoch": (uint(), True),
    }


@dataclass(frozen=True)
class Status(Message):
    instance: str
    role: int
    load: int
    queue: int
    ttl_ms: int
    accept_milli: int | None = None
    cache_mbps: int | None = None

    members: ClassVar = {
        "instance": (tstr, False),
        "role": (uint(), False),
        "load": (uint(le=100), False),
        "queue": (uint(), False),
        "accept_milli": (uint(le=1000), True),
        "cache_mbps": (uint(), True),
        "ttl_ms": (uint(), False),
    }

    def validate(self) -> None:
        if self.role not in (ROLE_DRAFTER, ROLE_VERIFIER):
            raise MessageError(f"status.role must be 1 or 2, not {self.role}")


@dataclass(frozen=True)
class Proposal(Message):
    """M proposed tokens. M == 0 decodes here and is refused by the session as sdcp-limit
    (../shared/spec/NOTES.md), so that a drafter learns which limit it broke rather than a bare 400."""

    session: bytes
    epoch: int
    round: int
    drafter: str
    base: int
    base_digest: bytes
    tokens: tuple[int, ...]
    status: Status
    q_rows: str | None = None
    draft_kv: str | None = None

    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "round": (uint(le=UINT32_MAX), False),
        "drafter": (tstr, False),
        "base": (uint(), False),
        "base_digest": (hash32, False),
        "tokens": (tokens, False),
        "q_rows": (cache_ref, True),
        "draft_kv": (cache_ref, True),
        "status": (nested(Status), False),
    }

    @property
    def m(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Verdict(Message):
    session: bytes
    epoch: int
    round: int
    accepted: int
    emitted: tuple[int, ...]
    committed: int
    digest: bytes
    action: Action
    m_cap: int
    low: int
    load: int

    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "round": (uint(le=UINT32_MAX), False),
        "accepted": (uint(), False),
        "emitted": (tokens, False),
        "committed": (uint(), False),
        "digest": (hash32, False),
        "action": (action(strict=False), False),
        "m_cap": (uint(), False),
        "low": (uint(), False),
        "load": (uint(le=100), False),
    }


@dataclass(frozen=True)
class Output(Message):
    session: bytes
    epoch: int
    start: int
    tokens: tuple[int, ...]
    final: bool
    finish: Action | None = None
    logprobs: TokenLogprobs | None = None   # extension: the target's, for exactly `tokens`

    # "from" is a Python keyword: the attribute is `start`, the CBOR key is "from"
    max_items: ClassVar[int] = cbor.DEFAULT_MAX_ITEMS   # an inline token list
    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "start": (uint(), False),
        "tokens": (tokens, False),
        "final": (boolean, False),
        "finish": (action(strict=False), True),
        "logprobs": (nested(TokenLogprobs, lenient=True), True),
    }

    def validate(self) -> None:
        if self.logprobs is not None and self.logprobs.count != len(self.tokens):
            raise MessageError(f"output.logprobs covers {self.logprobs.count} tokens, not the "
                               f"message's {len(self.tokens)}")

    @classmethod
    def from_obj(cls, obj: Mapping[Any, Any]) -> Output:
        if not isinstance(obj, Mapping):
            raise MessageError("output must be a map")
        fields = {k: v for k, v in obj.items() if k != "from"}
        fields["start"] = obj.get("from")
        return super().from_obj(fields)

    def to_obj(self) -> dict[str, Any]:
        out = super().to_obj()
        out["from"] = out.pop("start")
        return out


@dataclass(frozen=True)
class Event(Message):
    session: bytes
    epoch: int
    kind: Action
    committed: int
    digest: bytes

    members: ClassVar = {
        "session": (session_id, False),
        "epoch": (uint(), False),
        "kind": (action(strict=False), False),
        "committed": (uint(), False),
        "digest": (hash32, False),
    }


@dataclass(frozen=True)
class Policy(Message):
    session: bytes
    from_round: int
    sampling: Sampling
    router_epoch: int | None = None       # extension: the sending router's ownership epoch

    members: ClassVar = {
        "session": (session_id, False),
        "from_round": (uint(le=UINT32_MAX), False),
        "sampling": (nested(Sampling, lenient=True), False),
        "router_epoch": (uint(), True),
    }


@dataclass(frozen=True)
class CommitRecord(Message):
    """What the verifier appends to the commit log (section 6.3): epoch, round, emitted
    tokens, n and d[n]. Self-decoded rounds are records too."""

    epoch: int
    round: int
    emitted: tuple[int, ...]
    committed: int
    digest: bytes

    members: ClassVar = {
        "epoch": (uint(), False),
        "round": (uint(le=UINT32_MAX), False),
        "emitted": (tokens, False),
        "committed": (uint(), False),
        "digest": (hash32, False),
    }


ALL_MESSAGES: tuple[type[Message], ...] = (
    SessionOpen, SessionState, Assignment, Proposal, Verdict, Output, Status, Event, Policy,
)
