"""Hugging Face transformers backend (`hf:PATH`, the `[hf]` extra; imported lazily).

Loads a causal LM and its tokenizer from a local model directory, a `.gguf` file or
`smollm2` (the GGUF of the [real] extra), never the network (`local_files_only=True`). A
GGUF file is dequantised once into a cached safetensors copy (gguf_cache.py) and loaded
from there.

Spec options (`hf:PATH?dtype=bfloat16&device=cuda&threads=4`, unknown ones refused):
  dtype         float32 (default) | bfloat16 | float16: weights, K/V and computation;
                the returned logits are always fp32
  device        cpu (default) | cuda | cuda:N
  threads       torch's intra-op threads for this process (torch.set_num_threads)
  max_kv_bytes  cap on the K/V of all sessions together (default 1 GiB)
  max_seq_len   cap on one session's length (default and upper bound: the model's
                max_position_embeddings / n_positions)
  linear        measured (default) | library: on the CPU, each linear layer in whichever
                of two BLAS forms measures faster (linear_forms.py), or transformers'
                nn.Linear as shipped (its bits exactly: baselines, references)

KV cache: the pages of one pool (kv_pages.py) for models the packed pass serves, else one
transformers `DynamicCache` per session. `open` prefills the prompt; `score` computes only
the positions the session does not hold (usually the M + 1 new rows: the last committed
token, whose K/V a commit leaves out, and the proposal); `commit` drops what lies past the
longest prefix that agrees with the committed sequence (rejected positions; their pages go
back to the pool); `release` frees it. The bookkeeping (which tokens are cached, the logits
rows kept for a drafter's growing proposal) is prefix_cache.py, shared with the built-in
backend.

Batches: all sessions of a `score` go through ONE forward pass as a packed ragged batch
(hf_ragged.py): the new tokens of every session in one row, each with its own position id,
their K/V written into the pool in place, and attention in one SDPA call per layer for each
group of like sessions (gathered from the pool into a padded batch) and per fresh prompt.
No padding of the new tokens, and no per-session step per layer: a per-session attention
call, and a per-session concatenation that copied each session's whole past every step,
made a large batch's pass cost far more than transformers' own step (bench/RESULTS.md,
issue 38). Models whose attention it
cannot reproduce (sliding window, soft-capping, no AttentionInterface) run one session per
forward with their own attention. transformers' continuous-batching `PagedAttentionCache`
was not used: it is driven by its own request scheduler and block tables, and has no crop
to drop rejected positions from one request.

A pass computes at most `max_batch_tokens` (default 4096) new tokens; longer prefills run
in chunks of that size, which bounds activation memory.

Bounds: a session longer than `max_seq_len`, or K/V of all sessions over `max_kv_bytes`
(their pages of 16 positions, or their cached tokens, x layers x 2 x KV heads x head dim x
dtype size), raises `KVCapacityError` before any state changes; the pool's tensor never
grows past max_kv_bytes. Kept logits rows add at most (M + 1) x V fp32 per session.
`session_bytes` reports a session's K/V as allocated (its pages; or its cache's tensors,
where a crop leaves a view of the longer tensor until the next update copies) plus rows and
token lists; `bytes_for(n)` is the most a session of n positions holds, what the verifier's
and drafter's budgets reserve.

KV export/import: the kvblob format with the K/V of the committed prefix the cache holds,
[n_layer, 2, kv_heads, n, head_dim] in the model's dtype; import checks the model digest,
the shape and the dtype, and builds the session only when all of them hold.

Digest: canonical weights digest (see `weights.py`) of kind "hf" over the state dict's
tensors as loaded (their dtype included) and the config as canonical JSON without
transformers' bookkeeping keys (`transformers_version`, `dtype`, `torch_dtype`, keys
starting with "_"). A GGUF file and its converted copy give the same digest on every load.
Tokenizer digest: SHA-256 of the canonical JSON of the fast tokenizer's full description
plus its special-token map (real_tokenizer.hf_tokenizer_digest, which the drafts on the same
GGUF use too).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hf_ragged, kvblob
from .base import KVCapacityError, KVImportError
from .kv_pages import PagePool
from .linear_forms import measure_linear_forms
from .prefix_cache import CachedSession, CachingBackend, Plan
from .real_tokenizer import SMOLLM2, hf_tokenizer_digest, resolve_gguf
from .spec_options import choice, positive_int, split_options
from .weights import canonical_digest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPEC_OPTIONS = {
    "dtype": choice(*DTYPES),
    "device": lambda text: str(torch.device(text)),
    "threads": positive_int,
    "max_kv_bytes": positive_int,
    "max_seq_len": positive_int,
    "linear": choice("measured", "library"),
}
DEFAULT_MAX_KV_BYTES = 1 << 30
DEFAULT_MAX_BATCH_TOKENS = 4096
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype"}


def library_spec(spec: str) -> str:
    """An `hf:` spec with `linear=library` (transformers' own linear layers, its bits exactly):
    the target alone as a user runs it, for baselines and references. Other specs unchanged."""
    if not spec.startswith("hf:") or "linear=" in spec:
        return spec
    return f"{spec}{'&' if '?' in spec else '?'}linear=library"


@dataclass(eq=False)
class _Session(CachedSession):
    # K/V: pages of the backend's pool (packed passes), else a transformers DynamicCache
    pool: PagePool | None = None
    pages: list[int] = field(default_factory=list)  # in position order
    cache: object = None  # DynamicCache, batch 1, len(cached) positions (one-by-one models)

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self.restore()

    def restore(self) -> None:
        """Give back the pages, or crop every cache layer, beyond len(cached): after a
        truncation, or after a forward that failed with K/V already written."""
        if self.pool is not None:
            keep = self.pool.pages_for(len(self.cached))
            if len(self.pages) > keep:
                self.pool.give_back(self.pages[keep:])
                del self.pages[keep:]
            return
        for layer in getattr(self.cache, "layers", ()):
            extra = layer.get_seq_length() - len(self.cached)
            if extra > 0:
                layer.crop(-extra)

    def release(self) -> None:
        if self.pool is not None:
            self.pool.give_back(self.pages)
            self.pages = []


@dataclass(frozen=True)
class _Chunk:
    """New tokens of one session computed in one pass, and which of their rows to keep."""

    session: _Session
    tokens: list[int]
    start: int  # position of tokens[0] (= the session's cached length before the pass)
    keep_from: int  # index into tokens of the first row to return


class HFBackend(CachingBackend):
    kind = "hf"

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int | None = None,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        max_seq_len: int | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        ragged: bool | None = None,
        linear: str = "measured",
    ) -> None:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("hf: backends need the [hf] extra (transformers)") from e
        if threads:
            torch.set_num_threads(threads)
        path = Path(path)
        if path.suffix.lower() == ".gguf":
            from .gguf_cache import converted_dir

            path = converted_dir(path)
        elif not path.is_dir():
            raise FileNotFoundError(f"hf: model directory or .gguf file not found: {path}")
        self.device = self.rows_device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=self.dtype, local_files_only=True
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        # linear layers in the form the BLAS runs faster, measured (linear_forms.py);
        # "library" keeps transformers' nn.Linear, bit for bit (baselines, references)
        self.linear_forms = measure_linear_forms(self.model) if linear == "measured" else None
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        config = self.model.config
        text = config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        self.max_seq_len = min(filter(None, (limit, max_seq_len)), default=None)
        self.max_kv_bytes = max_kv_bytes
        self.max_batch_tokens = max_batch_tokens
        heads = text.num_attention_heads
        self.kv_shape = (  # per token: layers, K and V, KV heads, head dim
            text.num_hidden_layers,
            2,
            getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads,
        )
        n_layer, two, kv_heads, head_dim = self.kv_shape
        self.bytes_per_token = n_layer * two * kv_heads * head_dim * self.dtype.itemsize
        self.ragged = hf_ragged.supports_ragged(self.model) if ragged is None else ragged
        self.pool = None
        if self.ragged:
            hf_ragged.register()
            self.model.set_attn_implementation(hf_ragged.NAME)
            self.pool = PagePool(n_layer, kv_heads, head_dim, self.dtype, self.device, max_bytes=max_kv_bytes)
        config_dict = {
            k: v
            for k, v in config.to_dict().items()
            if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")
        }
        self.digest = canonical_digest(
            self.kind,
            json.dumps(config_dict, sort_keys=True, separators=(",", ":"), default=str),
            self.model.state_dict(),
        )
        self.tokenizer_digest = hf_tokenizer_digest(self.tokenizer)
        self._sessions: dict[bytes, _Session] = {}

    @classmethod
    def from_spec(cls, arg: str, **options) -> HFBackend:
        """`hf:SOURCE?options`: SOURCE is a model directory, a .gguf file or `smollm2`."""
        source, opts = split_options(arg, SPEC_OPTIONS, "hf")
        return cls(resolve_gguf(source) if source == SMOLLM2 else source, **(opts | options))

    # -- text -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # -- sessions (open, commit, score: prefix_cache.CachingBackend) ------------------------
    def _new_session(self, prompt: list[int]) -> _Session:
        if self.pool is not None:
            return _Session(committed=prompt, pool=self.pool)
        from transformers import DynamicCache

        return _Session(committed=prompt, cache=DynamicCache())

    def release(self, session: bytes) -> None:
        s = self._get(session)
        super().release(session)
        s.release()

    @property
    def copies_prefixes(self) -> bool:
        """Sessions in the pool's pages open with a copy of a prefix others hold (prefix_cache.py)."""
        return self.pool is not None

    def _copy_prefix(self, source: _Session, target: _Session, n: int) -> None:
        pages = self.pool.take(self.pool.pages_for(n))   # may raise KVCapacityError: nothing changed
        self.pool.copy(source.pages, pages, n)
        target.pages = pages
        target.cached, target.rows_start = source.cached[:n], n

    def kv_bytes(self) -> int:
        """Bytes of K/V all sessions hold (what `max_kv_bytes` caps): their pages, or their
        cached positions."""
        if self.pool is not None:
            return self.pool.held * self.pool.page_bytes
        return self.bytes_per_token * sum(len(s.cached) for s in self._sessions.values())

    def session_bytes(self, session: bytes) -> int:
        """The session's K/V as allocated (its pages; or its cache's tensors, where a crop
        keeps a view of the longer tensor until the next update copies), its kept logits
        rows and token lists."""
        s = self._get(session)
        if s.pool is not None:
            kv = len(s.pages) * s.pool.page_bytes
        else:
            kv = sum(
                t.untyped_storage().nbytes()
                for layer in getattr(s.cache, "layers", ())
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if t is not None
            )
        return kv + self._bookkeeping_bytes(s)

    def bytes_for(self, tokens: int) -> int:
        """K/V of `tokens` positions (whole pages; or exactly as long as the cache, whose
        update concatenates), the fp32 rows of a longest proposal, two token lists."""
        if self.max_seq_len is not None:
            tokens = min(tokens, self.max_seq_len)
        if self.pool is not None:
            kv = self.pool.pages_for(tokens) * self.pool.page_bytes
        else:
            kv = tokens * self.bytes_per_token
        return kv + self._bookkeeping_bytes_for(tokens)

    def _reserve(self, plans: list[Plan]) -> None:
        if self.pool is not None:
            more = sum(max(0, self.pool.pages_for(len(p.full)) - len(p.session.pages)) for p in plans)
            if not self.pool.fits(more):
                self.pool.take(more)  # raises KVCapacityError, saying how much
            return
        self._check_kv(sum(len(p.full) - len(p.session.cached) for p in plans))

    # -- scoring ----------------------------------------------------------------------------
    def _compute(self, plans: list[Plan]) -> dict[int, torch.Tensor]:
        try:
            return self._compute_passes(plans)
        except BaseException:  # layers a failed pass extended are cropped back
            for p in plans:
                p.session.restore()
            raise

    def _compute_passes(self, plans: list[Plan]) -> dict[int, torch.Tensor]:
        """fp32 rows from each plan's first kept row on, keyed by id(plan); K/V stored.
        Passes of at most max_batch_tokens new tokens; a long prefill spans several."""
        rows: dict[int, list[torch.Tensor]] = {id(p): [] for p in plans}
        done = {id(p): 0 for p in plans}  # tokens of each plan already computed
        pending = list(plans)
        while pending:
            budget, wave = self.max_batch_tokens, []
            for p in pending:
                n = min(len(p.new_tokens) - done[id(p)], budget)
                if n <= 0:
                    break
                offset = p.start + done[id(p)]
                keep_from = min(max(0, p.first_row - offset), n)  # rows before first_row: none
                wave.append((p, _Chunk(p.session, p.full[offset : offset + n], offset, keep_from)))
                budget -= n
            outs = self._forward_ragged([c for _, c in wave]) if self.ragged else [
                self._forward_one(c) for _, c in wave
            ]
            for (p, chunk), out in zip(wave, outs, strict=True):
                done[id(p)] += len(chunk.tokens)
                rows[id(p)].append(out)
            pending = [p for p in pending if done[id(p)] < len(p.new_tokens)]
        return {key: torch.cat(parts) for key, parts in rows.items()}

    def _forward_ragged(self, chunks: list[_Chunk]) -> list[torch.Tensor]:
        tokens, positions, spans, keep = [], [], [], []
        for c in chunks:
            lo = len(tokens)
            tokens += c.tokens
            positions += range(c.start, c.start + len(c.tokens))
            s, need = c.session, self.pool.pages_for(c.start + len(c.tokens))
            if len(s.pages) < need:  # _reserve checked that they fit
                s.pages += self.pool.take(need - len(s.pages))
            spans.append(hf_ragged.SpanPlan(lo, len(tokens), c.start, s.pages))
            keep += range(lo + c.keep_from, len(tokens))
        with self._timed_pass(len(tokens)):
            logits = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                sdcp_ragged=hf_ragged.paged_layout(self.pool, spans),
            ).logits[0].float()
        return list(logits.split([len(c.tokens) - c.keep_from for c in chunks]))

    def _timed_pass(self, rows: int):
        """A pass over `rows` new tokens, its linear layers' form chosen and timed."""
        return contextlib.nullcontext() if self.linear_forms is None else self.linear_forms.pass_over(rows)

    def _forward_one(self, c: _Chunk) -> torch.Tensor:
        """One session through the model's own attention (models the packed pass cannot take)."""
        n = len(c.tokens)
        with self._timed_pass(n):
            out = self.model(
                input_ids=torch.tensor([c.tokens], device=self.device),
                position_ids=torch.arange(c.start, c.start + n, device=self.device)[None],
                cache=c.session.cache,
                use_cache=True,
                logits_to_keep=torch.arange(c.keep_from, n, device=self.device),
            )
        return out.logits[0].float()

    # -- export / import --------------------------------------------------------------------
    def export_kv(self, session: bytes) -> bytes:
        """The committed sequence and the K/V of the committed prefix the cache holds."""
        s = self._get(session)
        n = s.committed_kv_tokens()
        kv = None
        if n and s.pool is not None:
            kv = s.pool.read(s.pages, n)
        elif n:
            kv = torch.stack(
                [torch.stack([layer.keys[0, :, :n], layer.values[0, :, :n]])
                 for layer in s.cache.layers]
            )  # [n_layer, 2, kv_heads, n, head_dim]
        return kvblob.pack(self.kind, self.digest, self.vocab_size, s.committed, kv, n)

    def import_kv(self, session: bytes, data: bytes) -> None:
        blob, committed = kvblob.unpack_for(self, session, data)
        n = blob.kv_tokens
        if n and blob.kv is None:
            raise KVImportError("KV blob claims cached tokens but carries no K/V")
        if blob.kv is not None:
            layers, two, heads, dim = self.kv_shape
            expect = [layers, two, heads, n, dim]
            if list(blob.kv.shape) != expect:
                raise KVImportError(f"KV shape {list(blob.kv.shape)} does not match the model's {expect}")
            if blob.kv.dtype != self.dtype:
                raise KVImportError(f"KV dtype {blob.kv.dtype} is not the model's {self.dtype}")
        self._check_kv(n)
        s = self._new_session(committed)
        if n and s.pool is not None:
            s.pages = s.pool.take(s.pool.pages_for(n))
            s.pool.write(s.pages, 0, blob.kv.to(self.device))
        elif n:
            for i, layer in enumerate(blob.kv.to(self.device)):  # [2, kv_heads, n, head_dim]
                s.cache.update(layer[0][None].contiguous(), layer[1][None].contiguous(), i)
        s.cached, s.rows_start = committed[:n], n
        self._sessions[session] = s

    # -- memory -----------------------------------------------------------------------------
    def _check_kv(self, more_tokens: int) -> None:
        if self.pool is not None:
            if not self.pool.fits(self.pool.pages_for(more_tokens)):
                self.pool.take(self.pool.pages_for(more_tokens))  # raises, saying how much
            return
        want = self.kv_bytes() + more_tokens * self.bytes_per_token
        if want > self.max_kv_bytes:
            raise KVCapacityError(
                f"K/V would grow to {want} bytes, over max_kv_bytes={self.max_kv_bytes}; "
                "release sessions"
            )
