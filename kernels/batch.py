"""The ragged verify batch, its result, and a builder from per-proposal Python values.

Layout (B proposals, proposal b drafted M_b >= 1 tokens):
- logits rows: proposal b owns M_b + 1 consecutive rows starting at `row_start[b]`; row
  `row_start[b] + i` is the target distribution for 0-based position i (i = M_b is the row
  used when all M_b tokens are accepted).
- draft tokens and acceptance uniforms: proposal b owns M_b consecutive entries starting at
  `token_start[b]`.
- extra-token uniforms follow the logits rows: entry `row_start[b] + i` is the purpose-1 value
  for 1-based position i + 1, so the kernel picks the one at i = a + 1 itself (a is only known
  inside the op). Callers with one value per proposal (a CSPRNG) may repeat it.
- q rows (rule 2 only): proposal b owns M_b consecutive rows of `q` starting at `q_start[b]`;
  rule-1 proposals have `q_start == -1` and own no q rows. This lets the cache loader land all
  rule-2 rows of a batch in one preallocated [sum M_rule2, V] fp32 tensor, at any offsets.

Sampling profile per proposal: `temperature_milli` (0 = greedy), `top_k` (0 = off),
`top_p_milli` (1000 = off); absent keys take the defaults of ../shared/spec/NOTES.md, section
"Sampling profile -> target distribution p" (1000, 0, 1000). The kernels accept any M >= 1;
the contract's m_max bound (1..64) is the core's to check.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_TEMPERATURE_MILLI = 1000
DEFAULT_TOP_K = 0
DEFAULT_TOP_P_MILLI = 1000

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class VerifyInputError(ValueError):
    """A verify batch whose shapes, dtypes or values are inconsistent."""


@dataclass(frozen=True)
class VerifyBatch:
    logits: torch.Tensor  # [R, V] fp32 | bf16 | fp16, R = sum(M_b + 1), contiguous rows
    draft_tokens: torch.Tensor  # [N] int64, N = sum(M_b)
    num_draft: torch.Tensor  # [B] int64, M_b >= 1
    rule: torch.Tensor  # [B] int64, 1 (greedy) or 2 (speculative sampling)
    temperature_milli: torch.Tensor  # [B] int64, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p_milli: torch.Tensor  # [B] int64 in 0..1000, 1000 = off
    q: torch.Tensor | None  # [Q, V] fp32 draft probabilities (rule-2 rows), None if no rule 2
    q_start: torch.Tensor  # [B] int64, first q row of proposal b; -1 for rule 1
    accept_uniforms: torch.Tensor  # [N] float64 in [0, 1), purpose 0, position i = 1..M_b
    extra_uniforms: torch.Tensor  # [R] float64 in [0, 1), row layout: purpose 1 at i = 1..M_b+1
    row_start: torch.Tensor  # [B] int64, first logits row of proposal b
    token_start: torch.Tensor  # [B] int64, first draft token of proposal b

    @property
    def num_proposals(self) -> int:
        return int(self.num_draft.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[1])

    def validate(self, *, rule2_has_q: bool = False) -> None:
        """Raise VerifyInputError for inconsistent shapes/dtypes (cheap; no device sync
        beyond the sizes that are needed anyway). `rule2_has_q`: the caller has checked that
        rule-2 proposals come with q rows (build_batch does, from the Python values), so the
        rule tensor need not be searched for them."""
        lg = self.logits
        if lg.dim() != 2 or lg.dtype not in LOGIT_DTYPES:
            raise VerifyInputError(f"logits must be [R, V] fp32/bf16/fp16, got {lg.dtype} {tuple(lg.shape)}")
        b = self.num_proposals
        for name in ("rule", "temperature_milli", "top_k", "top_p_milli", "q_start",
                     "row_start", "token_start"):
            t = getattr(self, name)
            if t.shape != (b,):
                raise VerifyInputError(f"{name} must have shape [{b}], got {tuple(t.shape)}")
        n = int(self.draft_tokens.shape[0])
        if self.accept_uniforms.shape != (n,):
            raise VerifyInputError("accept_uniforms must have one entry per draft token")
        if self.extra_uniforms.shape != (n + b,):
            raise VerifyInputError("extra_uniforms must have M_b + 1 entries per proposal")
        if self.accept_uniforms.dtype != torch.float64 or self.extra_uniforms.dtype != torch.float64:
            raise VerifyInputError("uniforms must be float64")
        if lg.shape[0] != n + b:
            raise VerifyInputError(f"logits must have sum(M_b + 1) = {n + b} rows, got {lg.shape[0]}")
        if self.q is not None and (self.q.dtype != torch.float32 or self.q.dim() != 2
                                   or self.q.shape[1] != lg.shape[1]):
            raise VerifyInputError("q must be [Q, V] fp32 with the logits' V")
        for name in ("draft_tokens", "num_draft", "q_start", "accept_uniforms", "extra_uniforms"):
            if getattr(self, name).device != lg.device:
                raise VerifyInputError(f"{name} must be on the logits' device {lg.device}")
        if self.q is not None and self.q.device != lg.device:
            raise VerifyInputError("q must be on the logits' device")
        if self.q is None and not rule2_has_q and lg.device.type == "cpu" and bool((self.rule == 2).any()):
            # (checked where it costs no device sync; build_batch checks it everywhere)
            raise VerifyInputError("rule-2 proposals need q rows")
        object.__setattr__(self, "_validated", True)

    def validate_once(self) -> None:
        """`validate`, unless this batch has passed it already (`build_batch` validates what
        it builds; the launch need not check the same tensors a second time)."""
        if not self.__dict__.get("_validated"):
            self.validate()


@dataclass(frozen=True)
class VerifyResult:
    accepted: torch.Tensor  # [B] int64, a in 0..M_b (0 when a flag is set)
    extra_token: torch.Tensor  # [B] int64, the additional token (-1 when a flag is set)
    bad_q: torch.Tensor  # [B] bool, some q[i](x[i]) zero, negative or non-finite: refuse
    nan_logits: torch.Tensor  # [B] bool, a logits row with NaN or +inf, or no finite value

    def rows(self) -> list[tuple[int, int, bool, bool]]:
        """(accepted, extra_token, bad_q, nan_logits) per proposal, as Python values."""
        return list(zip(self.accepted.tolist(), self.extra_token.tolist(),
                        self.bad_q.tolist(), self.nan_logits.tolist(), strict=True))


@dataclass(frozen=True)
class ProposalInput:
    """One proposal as Python values, for `build_batch`."""

    rule: int  # 1 or 2
    tokens: Sequence[int]  # the M draft tokens x[1..M]
    accept_uniforms: Sequence[float]  # M values r[1..M] (purpose 0)
    # purpose-1 values for i = 1..M+1 (the op uses the one at i = a + 1); one float = any i
    extra_uniforms: Sequence[float] | float
    sampling: Mapping[str, int] = field(default_factory=dict)  # temperature_milli/top_k/top_p_milli
    q_start: int | None = None  # first row in q (rule 2); None = next free row in order


_SAMPLING_KEYS = {"temperature_milli", "top_k", "top_p_milli"}


def sampling_profile(sampling: Mapping[str, int] | None) -> tuple[int, int, int]:
    """(temperature_milli, top_k, top_p_milli) with the defaults for absent keys
    (../shared/spec/NOTES.md, "Sampling profile -> target distribution p")."""
    sampling = sampling or {}
    unknown = set(sampling) - _SAMPLING_KEYS
    if unknown:
        raise VerifyInputError(f"unknown sampling keys {sorted(unknown)}")
    t = int(sampling.get("temperature_milli", DEFAULT_TEMPERATURE_MILLI))
    k = int(sampling.get("top_k", DEFAULT_TOP_K))
    p = int(sampling.get("top_p_milli", DEFAULT_TOP_P_MILLI))
    if t < 0 or k < 0 or not 0 <= p <= 1000:
        raise VerifyInputError(f"bad sampling profile {dict(sampling)}")
    return t, k, p


@dataclass(frozen=True)
class PackedResult:
    """A verify result as one tensor (the native op's `verify_packed`): row 0 accepted, row 1
    extra_token, row 2 bad_q, row 3 nan_logits (0 or 1), one column per proposal."""

    packed: torch.Tensor  # [4, B] int64

    def rows(self) -> list[tuple[int, int, bool, bool]]:
        """(accepted, extra_token, bad_q, nan_logits) per proposal, as Python values (one
        read of the tensor)."""
        accepted, extra, bad_q, nan_logits = self.packed.tolist()
        return list(zip(accepted, extra, map(bool, bad_q), map(bool, nan_logits), strict=True))


# the [B] fields of PackedBatch.ints, in order (the draft tokens follow them)
PACKED_FIELDS = ("num_draft", "rule", "temperature_milli", "top_k", "top_p_milli", "q_start",
                 "row_start", "token_start")


@dataclass(frozen=True)
class PackedBatch:
    """A verify batch as two buffers, before any per-field view: what `pack_batch` makes
    from Python values. The native op reads it as it is (`verify_packed`); every other path
    takes its `unpack()`, the VerifyBatch of views into the same two tensors. (Thirteen
    views and a validation pass cost more host time than the native op's whole verify of
    one proposal.)"""

    logits: torch.Tensor  # [R, V] fp32 | bf16 | fp16, R = N + B
    ints: torch.Tensor  # [8B + N] int64: PACKED_FIELDS ([B] each), then draft_tokens [N]
    floats: torch.Tensor  # [N + R] float64: accept_uniforms [N], then extra_uniforms [R]
    q: torch.Tensor | None  # [Q, V] fp32 draft probabilities (rule-2 rows), None if no rule 2
    num_proposals: int  # B

    def unpack(self) -> VerifyBatch:
        """The same batch as a validated VerifyBatch (views, no copy)."""
        b = self.num_proposals
        n = int(self.ints.shape[0]) - 8 * b
        *fields, draft_tokens = self.ints.split([b] * 8 + [n])
        batch = VerifyBatch(logits=self.logits, draft_tokens=draft_tokens, q=self.q,
                            accept_uniforms=self.floats[:n], extra_uniforms=self.floats[n:],
                            **dict(zip(PACKED_FIELDS, fields, strict=True)))
        batch.validate(rule2_has_q=True)   # each rule-2 proposal's q rows were checked in pack_batch
        return batch


def build_batch(logits: torch.Tensor, proposals: Sequence[ProposalInput],
                q: torch.Tensor | None = None) -> VerifyBatch:
    """Make the batch tensors (on the logits' device) from per-proposal Python values.

    `logits` holds sum(M_b + 1) rows in proposal order. `q` holds the rule-2 rows; when a
    proposal's `q_start` is None its rows are taken to follow the previous rule-2 proposal's.
    """
    return pack_batch(logits, proposals, q).unpack()


def pack_batch(logits: torch.Tensor, proposals: Sequence[ProposalInput],
               q: torch.Tensor | None = None) -> PackedBatch:
    """`build_batch`'s checks and tensors, without the views: a PackedBatch."""
    if not proposals:
        raise VerifyInputError("empty batch")
    dev = logits.device
    tokens: list[int] = []
    accept_u: list[float] = []
    num_draft, rules, temps, topks, topps, q_starts, extra_u = [], [], [], [], [], [], []
    next_q = 0
    for idx, pr in enumerate(proposals):
        m = len(pr.tokens)
        if m < 1:
            raise VerifyInputError(f"proposal {idx}: M must be >= 1")
        if len(pr.accept_uniforms) != m:
            raise VerifyInputError(f"proposal {idx}: need {m} acceptance uniforms")
        if pr.rule not in (1, 2):
            raise VerifyInputError(f"proposal {idx}: rule must be 1 or 2, got {pr.rule}")
        t, k, p = sampling_profile(pr.sampling)
        if pr.rule == 2:
            start = next_q if pr.q_start is None else int(pr.q_start)
            if q is None or start < 0 or start + m > q.shape[0]:
                raise VerifyInputError(f"proposal {idx}: q rows {start}..{start + m} not in q")
            q_starts.append(start)
            next_q = start + m
        else:
            q_starts.append(-1)
        tokens.extend(map(int, pr.tokens))   # map, not a generator: no Python call per item
        accept_u.extend(map(float, pr.accept_uniforms))
        num_draft.append(m)
        rules.append(pr.rule)
        temps.append(t)
        topks.append(k)
        topps.append(p)
        if isinstance(pr.extra_uniforms, int | float):
            extra_u.extend([float(pr.extra_uniforms)] * (m + 1))
        elif len(pr.extra_uniforms) == m + 1:
            extra_u.extend(map(float, pr.extra_uniforms))
        else:
            raise VerifyInputError(f"proposal {idx}: need {m + 1} extra-token uniforms")
    v = logits.shape[-1]
    if min(tokens) < 0 or max(tokens) >= v:   # every M_b >= 1: never empty
        raise VerifyInputError(f"draft token out of range 0..{v - 1}")
    token_start, row_start, at = [], [], 0
    for idx, m in enumerate(num_draft):
        token_start.append(at)
        row_start.append(at + idx)
        at += m
    # two tensors made (a tensor costs microseconds of Python and dispatch each; a batch of
    # one is the common case at low load)
    ints = list_tensor([*num_draft, *rules, *temps, *topks, *topps, *q_starts, *row_start, *token_start,
                        *tokens], torch.int64, dev)
    floats = list_tensor([*accept_u, *extra_u], torch.float64, dev)
    return PackedBatch(logits, ints, floats, q, len(proposals))


_ARRAY_CODES = {torch.int64: "q", torch.float64: "d"}


def list_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
                device: torch.device | str | None = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` for a list of Python ints (int64) or
    floats (float64), made on the host as a C array that the tensor wraps in place:
    about a third of torch.tensor's cost for the dozen values of a round (no per-element type
    inference), then moved to `device` if that is not the CPU. Unlike torch.tensor it refuses
    a float in an int64 list (TypeError) rather than truncating it."""
    code = _ARRAY_CODES[dtype]
    if not values:   # torch.frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype, device=device)
    tensor = torch.frombuffer(array.array(code, values), dtype=dtype)
    if device is not None and (device if isinstance(device, torch.device) else torch.device(device)).type != "cpu":
        tensor = tensor.to(device)
    return tensor
