"""`replay:PATH`: the benchmark draft that plays back recorded continuations."""

from __future__ import annotations

import pytest
import torch

from sdcp_fast.models import Backend, ModelError, load_backend
from sdcp_fast.models.replay import OFF_RECORD, write_replay

V = 50
TOK = bytes(range(32))


@pytest.fixture
def replay_path(tmp_path):
    path = tmp_path / "replay.json"
    write_replay(path, [([1, 2, 3], [10, 11, 12, 13]), ([1, 2, 4], [20, 21])], V, TOK)
    return path


def onehot(token):
    row = torch.full((V,), OFF_RECORD)
    row[token] = 0.0
    return row


def test_rows_follow_the_record_and_are_flat_off_it(replay_path):
    be = load_backend(f"replay:{replay_path}")
    assert isinstance(be, Backend) and be.tokenizer_digest == TOK and be.vocab_size == V
    be.open(b"a", [1, 2, 3])
    be.open(b"b", [1, 2, 4, 20])  # opened past its prompt (a drafter joining late)
    be.open(b"c", [9, 9])  # not recorded
    out = be.score([(b"a", [10, 11]), (b"b", [21]), (b"c", [1])])
    assert out.shape == (3 + 2 + 2, V) and out.dtype == torch.float32
    expected = [onehot(10), onehot(11), onehot(12), onehot(21), torch.zeros(V)]
    for row, want in zip(out[:5], expected, strict=True):
        assert torch.equal(row, want)
    assert torch.equal(out[5:], torch.zeros(2, V))
    # a wrong proposal leaves the record from the diverging token on; past the end is flat
    out = be.score([(b"a", [10, 49, 12])])
    assert torch.equal(out[0], onehot(10)) and torch.equal(out[1], onehot(11))
    assert torch.equal(out[2:], torch.zeros(2, V))
    be.commit(b"a", [10, 11, 12, 13])
    assert torch.equal(be.score([(b"a", [])]), torch.zeros(1, V))
    # a greedy drafter proposes exactly the recorded continuation
    be.open(b"d", [1, 2, 3])
    drafted = []
    for _ in range(4):
        drafted.append(int(be.score([(b"d", drafted)])[-1].argmax()))
    assert drafted == [10, 11, 12, 13]
    with pytest.raises(ModelError):
        be.encode("text")


def test_digest_names_the_recording(replay_path, tmp_path):
    a, b = load_backend(f"replay:{replay_path}"), load_backend(f"replay:{replay_path}")
    assert a.digest == b.digest and len(a.digest) == 32
    other = tmp_path / "other.json"
    write_replay(other, [([1, 2, 3], [10, 11, 12, 14])], V, TOK)
    assert load_backend(f"replay:{other}").digest != a.digest
    a.open(b"x", [1, 2, 3])
    b.import_kv(b"y", a.export_kv(b"x"))
    assert torch.equal(a.score([(b"x", [10])]), b.score([(b"y", [10])]))


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a replay file"):
        load_backend(f"replay:{bad}")
    with pytest.raises(ValueError, match="outside"):
        write_replay(bad, [([1], [V])], V, TOK)
        load_backend(f"replay:{bad}")
