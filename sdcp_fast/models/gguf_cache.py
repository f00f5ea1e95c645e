"""GGUF files as Hugging Face model directories: dequantised once, then memory-mapped.

transformers reads a GGUF file (with the `gguf` package and `accelerate`) by dequantising
every tensor to fp32, which takes tens of seconds for a 135M model on a small CPU, and a
model loaded that way cannot `save_pretrained`. So the first load copies the dequantised
state dict into a plain model of the same config and saves that, with the tokenizer, as an
ordinary model directory (safetensors); every later load reads that directory, whose
tensors transformers memory-maps.

    $SDCP_CACHE (default ~/.cache/sdcp-fast)/gguf/<SHA-256 of the GGUF file>/
        config.json, model.safetensors, tokenizer files, ...
        sdcp-manifest.json   {"format", "source", "source_sha256", "files": {name: SHA-256}}

The entry is keyed by the file's content, not its name. The manifest is written last and the
directory renamed into place, so a half-built entry is never found; on every use each file
is hashed again and compared with the manifest, and an entry that is truncated, corrupt or
incomplete is rebuilt, never trusted. One build at a time per entry (an exclusive `flock`),
so processes that start together (a router and a verifier) convert the file once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .real_tokenizer import cache_dir, file_sha256

log = logging.getLogger("sdcp_fast.models.gguf_cache")

MANIFEST = "sdcp-manifest.json"
FORMAT = 1


def converted_dir(gguf_path: str | Path) -> Path:
    """The model directory holding `gguf_path` dequantised, building it if it is missing
    or does not match its manifest."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"hf: GGUF file not found: {gguf_path}")
    source_sha = file_sha256(gguf_path)
    root = cache_dir() / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    entry = root / source_sha
    with open(root / f"{source_sha}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        problem = entry_problem(entry, source_sha)
        if problem is None:
            return entry
        if entry.exists():
            log.warning("GGUF cache entry %s is not usable (%s): rebuilding", entry, problem)
        build(gguf_path, source_sha, entry)
    return entry


def entry_problem(entry: Path, source_sha: str) -> str | None:
    """Why the entry cannot be used, or None when every file matches its manifest."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"no readable manifest ({e})"
    if manifest.get("format") != FORMAT or manifest.get("source_sha256") != source_sha:
        return "manifest of another format or file"
    files = manifest.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return "manifest lists no model files"
    for name, sha in files.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != sha:
            return f"{name} does not match its SHA-256 (truncated or corrupt)"
    return None


def build(gguf_path: Path, source_sha: str, entry: Path) -> None:
    """Dequantise `gguf_path` into a new directory and move it into place as `entry`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors copy in %s (once per file)", gguf_path, entry)
    staging = Path(tempfile.mkdtemp(prefix=f".{source_sha[:16]}-", dir=entry.parent))
    try:
        where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the copy is plain fp32, not quantised
            del config.quantization_config
        with torch.device("meta"):  # no random init: every tensor comes from the GGUF file
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
        plain.tie_weights()
        plain.save_pretrained(staging)
        AutoTokenizer.from_pretrained(**where).save_pretrained(staging)
        del loaded, plain
        files = {
            p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()
        }
        manifest = {"format": FORMAT, "source": gguf_path.name, "source_sha256": source_sha,
                    "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for p in staging.iterdir():  # durable before it becomes visible
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if entry.exists():
            shutil.rmtree(entry)
        os.rename(staging, entry)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
