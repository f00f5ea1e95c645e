"""Model backend benchmark: forward cost and speculative decoding with the demo pair.

    .venv/bin/python bench/bench_models.py [--threads 2] [--quick]

Prints (markdown) three tables:
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
    for m in (2, 3, 4, 6, 8):
        t = time.perf_counter()
        results = [speculative(target, draft, p, n_tokens, m) for p in prompts]
        spec_s = time.perf_counter() - t
        for (tokens, _), ref in zip(results, reference, strict=True):
            assert tokens == ref, "greedy speculative output differs from target-only"
        rounds = sum(r for _, r in results)
        lines.append(
            f"| speculative M={m} | {n_prompts * n_tokens} | {spec_s:.2f} | "
            f"{n_prompts * n_tokens / spec_s:.0f} | {n_prompts * n_tokens / rounds:.2f} | "
            f"{base_s / spec_s:.2f} |"
        )
    print("\n".join(lines))
    print("\nsample (held-out prompt 0, target greedy):")
    print(repr(bytes(prompts[0][-60:]).decode("utf-8", "replace")), "->")
    print(repr(bytes(reference[0][:80]).decode("utf-8", "replace")))


if __name__ == "__main__":
    main()
