"""The table backend: logits are exactly table[last token]."""

from __future__ import annotations

import pytest
import torch

from sdcp_fast.models import InvalidTokens, load_backend, write_table
from sdcp_fast.models.table import TableBackend


@pytest.fixture
def table(tmp_path):
    t = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) * 3
    path = tmp_path / "table.safetensors"
    write_table(path, t)
    return t, path


def test_logits_are_exact_table_rows(table):
    t, path = table
    be = load_backend(f"table:{path}")
    assert be.vocab_size == 16
    be.open(b"a", [3, 1, 4])
    be.open(b"b", [15])
    out = be.score(
        [
            (b"a", [1, 5, 9]),
            (b"b", []),
        ]
    )
    assert out.dtype == torch.float32
    assert torch.equal(out, t[[4, 1, 5, 9, 15]])
    be.commit(b"a", [1, 5, 2])
    assert be.committed(b"a") == [3, 1, 4, 1, 5, 2]
    assert torch.equal(be.score([(b"a", [6])]), t[[2, 6]])


def test_digest_depends_on_every_entry_and_roundtrips_through_the_file(table, tmp_path):
    t, path = table
    be = load_backend(f"table:{path}")
    assert be.digest == TableBackend(t.clone()).digest
    changed = t.clone()
    changed[7, 3] = torch.nextafter(changed[7, 3], torch.tensor(1e9))
    assert TableBackend(changed).digest != be.digest
    assert len(be.digest) == 32 and len(be.tokenizer_digest) == 32


def test_text_is_decimal_ids(table):
    be = load_backend(f"table:{table[1]}")
    assert be.encode("3 1 4") == [3, 1, 4]
    assert be.decode([3, 1, 4]) == "3 1 4"
    with pytest.raises(InvalidTokens):
        be.encode("3 x")
    with pytest.raises(InvalidTokens):
        be.encode("16")


def test_write_table_rejects_non_square(tmp_path):
    with pytest.raises(ValueError, match=r"\[V, V\]"):
        write_table(tmp_path / "x.safetensors", torch.zeros(3, 4))


def test_empty_batch_and_foreign_sessions(table):
    be = load_backend(f"table:{table[1]}")
    assert be.score([]).shape == (0, 16)
    with pytest.raises(InvalidTokens):
        be.open(b"a", [])
