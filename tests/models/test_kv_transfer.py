"""KV export/import: across processes, validation of foreign and corrupt blobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import SMALL, random_model

from sdcp_fast.models import KVImportError, SessionExists, load_backend, write_table
from sdcp_fast.models.weights import save_tiny

WORKER = Path(__file__).with_name("kv_worker.py")


def run_worker(mode: str, spec: str, outdir: Path) -> None:
    subprocess.run([sys.executable, str(WORKER), mode, spec, str(outdir)], check=True, timeout=120)


@pytest.mark.parametrize("kind", ["tiny", "table"])
def test_exported_kv_continues_identically_in_another_process(kind, tiny_path, tmp_path):
    if kind == "tiny":
        spec = f"tiny:{tiny_path}"
    else:
        path = tmp_path / "table.safetensors"
        write_table(path, torch.randn(256, 256, generator=torch.Generator().manual_seed(1)))
        spec = f"table:{path}"
    run_worker("export", spec, tmp_path)
    run_worker("import", spec, tmp_path)
    original = torch.load(tmp_path / "original.pt")
    reimported = torch.load(tmp_path / "reimported.pt")
    imported = torch.load(tmp_path / "imported.pt")
    # Another process, same computation on the imported blob: bit-identical.
    assert torch.equal(imported["rows"], reimported["rows"])
    assert imported["chosen"] == reimported["chosen"] == original["chosen"]
    assert imported["committed"] == original["committed"]
    assert imported["committed"][:9] == [30, 31, 32, 33, 34, 35, 40, 41, 99]
    # Against the session that never left: same up to fp blocking (see test_tiny.py).
    torch.testing.assert_close(imported["rows"], original["rows"], atol=1e-4, rtol=1e-5)


def test_export_carries_committed_tokens_and_only_their_kv(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [1, 2, 3])
    be.score([(b"s", [4, 5, 6])])  # speculative K/V for 4, 5, 6
    be.commit(b"s", [4])
    other = load_backend(f"tiny:{tiny_path}")
    other.import_kv(b"t", be.export_kv(b"s"))
    assert other.committed(b"t") == [1, 2, 3, 4]
    assert other.cached_tokens(b"t") == [1, 2, 3, 4]  # speculative positions not exported
    with pytest.raises(SessionExists):
        other.import_kv(b"t", be.export_kv(b"s"))


def test_import_refuses_a_blob_from_another_model(tiny_path, tmp_path):
    other_path = tmp_path / "other.safetensors"
    save_tiny(random_model(SMALL, seed=1), other_path)
    a, b = load_backend(f"tiny:{tiny_path}"), load_backend(f"tiny:{other_path}")
    a.open(b"s", [1, 2, 3])
    with pytest.raises(KVImportError, match="another model"):
        b.import_kv(b"s", a.export_kv(b"s"))
    table = tmp_path / "t.safetensors"
    write_table(table, torch.zeros(256, 256))
    with pytest.raises(KVImportError, match="backend"):
        load_backend(f"table:{table}").import_kv(b"s", a.export_kv(b"s"))


def test_import_refuses_corrupt_or_truncated_blobs(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [1, 2, 3])
    blob = be.export_kv(b"s")
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    for bad, reason in [
        (blob[:-1], "checksum"),
        (bytes(flipped), "checksum"),
        (b"GARBAGE" + blob, "magic"),
        (b"", "magic"),
    ]:
        with pytest.raises(KVImportError, match=reason):
            be.import_kv(b"t", bad)
    assert be.sessions() == [b"s"]
