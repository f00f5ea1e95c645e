"""The `ngram:` prompt-lookup backend against the Backend contract, on the byte tokenizer
(`ngram:bytes`: V = 256, no model, no extra)."""

from __future__ import annotations

import pytest
import torch

from sdcp_fast import kernels
from sdcp_fast.models import (
    Backend,
    BackendSpecError,
    InvalidTokens,
    KVCapacityError,
    KVImportError,
    SessionExists,
    UnknownSession,
    load_backend,
)
from sdcp_fast.models.ngram import NgramBackend
from sdcp_fast.models.tokenizer import ByteTokenizer


def proposals(rows: torch.Tensor) -> list[int]:
    """The proposed token of each row, checking the row is one-hot (0 there, -inf elsewhere)."""
    out = []
    for row in rows:
        t = int(row.argmax())
        assert row[t] == 0.0
        assert torch.isneginf(torch.cat([row[:t], row[t + 1 :]])).all()
        out.append(t)
    return out


def lookup(seq: list[int], n: int, min_n: int = 1) -> tuple[int, int] | None:
    """Brute force: the token after the most recent earlier occurrence of the longest
    suffix of length n..min_n; None when nothing matches."""
    for k in range(min(n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[len(seq) - k :]
        for end in range(len(seq) - 2, k - 2, -1):
            if seq[end - k + 1 : end + 1] == suffix:
                return seq[end + 1], k
    return None


def test_spec_and_contract_attributes():
    be = load_backend("ngram:bytes?n=4&min=2")
    assert isinstance(be, Backend)
    assert (be.n, be.min_n, be.vocab_size) == (4, 2, 256)
    assert be.tokenizer_digest == ByteTokenizer().digest  # the tiny pair's tokenizer
    assert be.digest != load_backend("ngram:bytes?n=3").digest  # the options are the model
    assert be.digest == load_backend("ngram:bytes?min=2&n=4").digest
    for bad in ("ngram:bytes?m=2", "ngram:bytes?n=x", "ngram:bytes?n", "ngram:nowhere"):
        with pytest.raises(BackendSpecError):
            load_backend(bad)
    with pytest.raises(ValueError):
        load_backend("ngram:bytes?n=2&min=3")


def test_proposals_copy_the_most_recent_longest_match():
    be = load_backend("ngram:bytes?n=3")
    text = be.encode("the cat sat. the cat ran. the c")
    be.open(b"s", text)
    rows = be.score([(b"s", [])])
    assert proposals(rows) == [ord("a")]  # "the c" -> "a"
    assert be.match_length(b"s") == 3
    # a proposal is searched too, and every row is the lookup over C + x[:i]
    x = be.encode("at r")
    rows = be.score([(b"s", x)])
    seq = text + x
    expect = [lookup(seq[:j], 3)[0] for j in range(len(text), len(seq) + 1)]
    assert proposals(rows) == expect
    assert expect[-1] == ord("a")  # "t r" -> the most recent, "ran"


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force_over_random_sessions(seed):
    g = torch.Generator().manual_seed(seed)
    be = NgramBackend(ByteTokenizer(), n=3, min_n=1)
    sessions = {}
    for _ in range(60):
        sid = bytes([int(torch.randint(0, 3, (), generator=g))])
        if sid not in sessions:
            sessions[sid] = torch.randint(0, 6, (5,), generator=g).tolist()
            be.open(sid, sessions[sid])
            continue
        x = torch.randint(0, 6, (int(torch.randint(0, 5, (), generator=g)),), generator=g).tolist()
        rows = be.score([(sid, x)])
        seq = sessions[sid] + x
        got = proposals(rows)
        for i, j in enumerate(range(len(sessions[sid]), len(seq) + 1)):
            found = lookup(seq[:j], 3)
            assert got[i] == (found[0] if found else fallback(sessions[sid]))
        emitted = x[: int(torch.randint(0, len(x) + 1, (), generator=g))] + [7]
        be.commit(sid, emitted)
        sessions[sid] += emitted
        assert be.committed(sid) == sessions[sid]


def fallback(committed: list[int]) -> int:
    counts: dict[int, int] = {}
    best = 0
    for t in committed:
        counts[t] = counts.get(t, 0) + 1
        if counts[t] > counts.get(best, 0):
            best = t
    return best


def test_no_match_proposes_the_most_frequent_committed_token():
    be = load_backend("ngram:bytes?n=2")
    be.open(b"s", [5, 9, 9, 4, 9, 7])
    # the last token 7 never occurred before: nothing to copy
    assert proposals(be.score([(b"s", [])])) == [9]
    assert be.match_length(b"s") == 0
    assert be.match_length(b"s", [9]) == 1  # "9" did occur: followed most recently by 7


def test_rule2_q_is_one_hot_for_every_profile():
    be = load_backend("ngram:bytes")
    be.open(b"s", be.encode("abcabcab"))
    row = be.score([(b"s", [])])[0]
    for temp, top_k, top_p in [(700, 0, 1000), (1000, 5, 900), (50, 0, 1000), (4000, 0, 500)]:
        q = kernels.target_probs(row, temp, top_k, top_p)
        assert q[ord("c")] == 1.0 and q.sum() == 1.0


def test_several_sessions_in_one_call_and_errors():
    be = load_backend("ngram:bytes")
    be.open(b"a", [1, 2, 3, 1, 2])
    be.open(b"b", [4, 5, 4])
    rows = be.score([(b"b", [5]), (b"a", [])])
    assert rows.shape == (3, 256) and rows.dtype == torch.float32
    assert proposals(rows) == [5, 4, 3]
    with pytest.raises(SessionExists):
        be.open(b"a", [1])
    with pytest.raises(InvalidTokens):
        be.open(b"c", [])
    with pytest.raises(InvalidTokens):
        be.score([(b"a", [256])])
    with pytest.raises(UnknownSession):
        be.score([(b"zz", [])])
    with pytest.raises(Exception, match="twice"):
        be.score([(b"a", []), (b"a", [1])])
    be.release(b"a")
    with pytest.raises(UnknownSession):
        be.release(b"a")
    assert be.score([]).shape == (0, 256)
    small = NgramBackend(ByteTokenizer(), max_seq_len=4)
    with pytest.raises(KVCapacityError):
        small.open(b"s", [1, 2, 3, 4, 5])
    small.open(b"s", [1, 2, 3])
    with pytest.raises(KVCapacityError):
        small.score([(b"s", [1, 2])])
    assert small.committed(b"s") == [1, 2, 3]


def test_export_import_continues_identically():
    a, b = load_backend("ngram:bytes"), load_backend("ngram:bytes")
    a.open(b"s", b"one two one two thr".decode().encode())
    a.commit(b"s", list(b"ee one t"))
    blob = a.export_kv(b"s")
    b.import_kv(b"s", blob)
    assert b.committed(b"s") == a.committed(b"s")
    torch.testing.assert_close(b.score([(b"s", [119])]), a.score([(b"s", [119])]))
    with pytest.raises(SessionExists):
        b.import_kv(b"s", blob)
    with pytest.raises(KVImportError):
        load_backend("ngram:bytes?n=4").import_kv(b"s", blob)  # another "model"
    with pytest.raises(KVImportError):
        b.import_kv(b"t", blob[:-1])
