"""Acceptance and cost of each draft for SmolLM2-135M-Instruct (fp32 target), measured side
by side in one run, and the speedup they allow given the target's pass costs measured in the
same run.

    .venv/bin/python bench/bench_drafts.py                       # needs the [real] extra
    .venv/bin/python bench/bench_drafts.py --prompts 4 --drafts ngram,gguf

Drafts (backend specs): twin:smollm2 (the native int8 decoder, per-row scales),
twin:smollm2?group=32 (a scale per 32 columns), gguf:smollm2 (llama.cpp, the shipped Q4_1 file),
gguf:smollm2?type=q8_0 (requantised), ngram:smollm2, distilled:smollm2 (the trained draft),
distilled:smollm2?early=N (the target's first N layers).

Method, on held-out prompts (written here, not in scripts/draft_prompts.py) in the chat
template. A greedy continuation and one sampled at temperature 0.7, --new-tokens tokens each,
are written by the target's llama.cpp twin (fast; it agrees with the fp32 target at almost
every position, which is what the gguf rows below measure); then one forward of the fp32
target (transformers, loaded from the GGUF) over each sequence gives p at every
continuation position, and each draft's `score` over the same sequence (one call, teacher
forcing) gives q there. The target's greedy token at t is argmax p_t, whatever the context.
* Greedy (rule 1): m_t = [argmax q_t == argmax p_t]. A block drafted at position t has its
  i-th token accepted iff m_t .. m_{t+i-1} all hold (a deterministic draft given the same
  prefix proposes the same token; the context is the target's greedy path wherever the twin
  agrees with it), so the per-position acceptance is exact there:
  alpha_i = mean_t prod_{j<=i} m / mean_t prod_{j<i} m.
* Temperature 0.7 (rule 2): a_t = sum_x min(p_t(x), q_t(x)) with p and q after the same
  sampling profile (`kernels.target_probs`, temperature 0.7, the spec's default top-k/top-p):
  the exact probability that a token drafted from q_t is accepted. Per position,
  alpha_i = mean_t prod_{j<=i} a / mean_t prod_{j<i} a along the target's own sample; this
  takes the accepted prefix to be distributed like the target's sample (exact where p = q).
* Tokens per round at M: 1 + sum_{i=1..M} mean_t prod_{j<i} (m or a).
* Costs, through the Backend protocol as the drafter calls it: one `score` per drafted token
  on a growing proposal (context ~200 tokens), for 1, 4 and 8 sessions per call, at one torch
  thread as a drafter process runs (wall clock, and the calling thread's CPU time, which a
  busy machine disturbs less);
  the target's cached forward (transformers, DynamicCache) for 1, 4, 6, 9 new tokens at a
  context of 200, for 1 and 4 sessions, interpolated linearly in M + 1.
* Expected speedup at M (one session): tokens per round x t_target(1) / (M x t_draft +
  t_target(M + 1)); four sessions the same with the 4-session costs. The best M is printed.
The last line sums up for scripts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdcp_fast import kernels  # noqa: E402
from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.real_tokenizer import HFTokenizer, cache_dir, ensure_dir, resolve_gguf  # noqa: E402

HELD_OUT = [
    "How do I make a cup of green tea?",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "Give me three tips for writing a good resume.",
    "Explain what a prime number is, with examples.",
    "Why do cats purr?",
    "Describe a typical day of a lighthouse keeper.",
    "What should I pack for a weekend camping trip?",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small bakery and explain why.",
    "What are the planets of the solar system?",
    "Write two sentences encouraging someone before an exam.",
]
DEFAULT_DRAFTS = "twin:smollm2,twin:smollm2?group=32,gguf:smollm2,gguf:smollm2?type=q8_0,ngram:smollm2,distilled:smollm2,distilled:smollm2?early=4"
TEMPERATURE_MILLI = 700


def load_target(gguf: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def continuations(twin, prompts: list[list[int]], new: int, temperature: float | None, eos: int, seed: int = 0):
    """One continuation per prompt, cut after the end of turn, written by the target's llama.cpp
    twin (all prompts in one decode per step): transformers' generate() in fp32 took over
    half an hour for these on a busy 2-core machine. Acceptance is then measured against the
    fp32 target's own rows on these contexts (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)
    sids = [f"g{b}".encode() for b in range(len(prompts))]
    seqs = {s: list(p) for s, p in zip(sids, prompts, strict=True)}
    for s, p in zip(sids, prompts, strict=True):
        twin.open(s, p)
    active = list(sids)
    for _ in range(new):
        rows = twin.score([(s, []) for s in active])
        done = []
        for n, s in enumerate(active):
            if temperature is None:
                token = int(rows[n].argmax())
            else:
                token = int(torch.multinomial(torch.softmax(rows[n] / temperature, -1), 1, generator=gen))
            seqs[s].append(token)
            if token == eos:
                done.append(s)
            else:
                twin.commit(s, [token])
        active = [s for s in active if s not in done]
        if not active:
            break
    for s in sids:
        twin.release(s)
    return [seqs[s] for s in sids]


@torch.no_grad()
def target_rows(model, seq: list[int], start: int) -> torch.Tensor:
    """fp32 logits at positions start-1 .. len(seq)-2 (each predicts seq[pos + 1])."""
    logits = model(input_ids=torch.tensor([seq])).logits[0]
    return logits[start - 1 : len(seq) - 1].float()


def draft_rows(backend, seq: list[int], start: int) -> torch.Tensor:
    backend.open(b"bench", seq[:start])
    try:
        return backend.score([(b"bench", seq[start:-1])])  # rows start-1 .. len(seq)-2
    finally:
        backend.release(b"bench")


def chain_stats(ok: list[torch.Tensor], max_m: int) -> tuple[list[float], list[float]]:
    """(reach[i] = mean_t prod_{j<i} ok_{t+j} for i = 0..max_m, alpha_i = reach[i]/reach[i-1])
    over all block starts t of all sequences (blocks cut at the sequence end)."""
    num = [0.0] * (max_m + 1)
    den = [0] * (max_m + 1)
    for v in ok:
        v = v.double()
        n = len(v)
        prod = torch.ones(n)
        for i in range(max_m + 1):
            if i:
                prod = prod[: n - i + 1] * v[i - 1 : n]  # prod_{j<i} v[t + j], t = 0..n-i
            num[i] += float(prod.sum())
            den[i] += len(prod)
    reach = [num[i] / max(den[i], 1) for i in range(max_m + 1)]
    alpha = [reach[i] / reach[i - 1] if reach[i - 1] > 0 else 0.0 for i in range(1, max_m + 1)]
    return reach, alpha


def draft_cost(backend, context: list[int], sessions: int, m: int = 5, rounds: int = 3) -> tuple[float, float]:
    """(wall, thread CPU) seconds per `score` step when `sessions` sessions each draft one more
    token (as the drafter's batcher calls it), over `rounds` rounds of `m` tokens with a commit
    between. At one torch thread, as each serving process runs (procs.Cluster sets
    OMP_NUM_THREADS): with two, torch's copies of logits rows wait on OpenMP barriers while
    the other core is busy, which measured 2-3x the draft's own cost on a loaded machine."""
    sids = [f"c{k}".encode() for k in range(sessions)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for s in sids:
        backend.open(s, context)
    try:
        steps, spent, cpu = 0, 0.0, 0.0
        for r in range(rounds + 1):  # the first round warms up
            props = {s: [] for s in sids}
            started, cpu_started = time.perf_counter(), time.thread_time()
            for _ in range(m):
                rows = backend.score([(s, props[s]) for s in sids])
                ends = torch.cumsum(torch.tensor([len(props[s]) + 1 for s in sids]), 0) - 1
                for s, e in zip(sids, ends.tolist(), strict=True):
                    props[s].append(int(rows[e].argmax()))
            if r:
                spent += time.perf_counter() - started
                cpu += time.thread_time() - cpu_started
                steps += m
            for s in sids:
                backend.commit(s, props[s][:2])  # a partly accepted round
        return spent / steps, cpu / steps
    finally:
        for s in sids:
            backend.release(s)
        torch.set_num_threads(threads)


@torch.no_grad()
def target_costs(model, context: list[int], sessions: int, news=(1, 4, 6, 9), reps: int = 3) -> dict[int, float]:
    """Seconds of one cached forward of `n` new tokens for each of `sessions` sequences at a
    context of len(context) (median of `reps`; the cache is cropped back between them)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([context] * sessions), past_key_values=cache, use_cache=True)
    out = {}
    for n in news:
        times = []
        for _ in range(reps + 1):  # the first one warms up
            new = torch.tensor([[context[-1]] * n] * sessions)
            started = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - started)
            cache.crop(-n)  # transformers 5: a negative count removes that many tokens
        out[n] = sorted(times[1:])[len(times[1:]) // 2]
    return out


def interpolate(costs: dict[int, float], n: int) -> float:
    xs = sorted(costs)
    if n <= xs[0]:
        return costs[xs[0]]
    for a, b in zip(xs, xs[1:], strict=False):
        if n <= b:
            return costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a)
    a, b = xs[-2], xs[-1]
    return costs[b] + (costs[b] - costs[a]) * (n - b) / (b - a)


def best_speedup(reach: list[float], t_draft: float, t_target: dict[int, float]) -> tuple[float, int]:
    best = (0.0, 0)
    for m in range(1, len(reach)):
        tokens = sum(reach[: m + 1])  # 1 + sum_{i=1..m} reach[i]; reach[0] = 1
        rate = tokens / (m * t_draft + interpolate(t_target, m + 1))
        best = max(best, (rate * t_target[1], m))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafts", default=DEFAULT_DRAFTS)
    ap.add_argument("--max-m", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", type=int, default=0,
                    help="1: reuse the contexts, target rows and target costs of an earlier run "
                         "with the same --prompts/--new-tokens (kept in $SDCP_CACHE/bench-drafts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"# bench_drafts: {os.cpu_count()} CPUs, load average {load:.2f} at start, torch threads {args.threads}")
    gguf = resolve_gguf("smollm2")
    tok = HFTokenizer.from_gguf(gguf)
    eos = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    t0 = time.perf_counter()
    model = load_target(gguf)
    print(f"# target loaded in {time.perf_counter() - t0:.0f} s; vocabulary {model.config.vocab_size}")
    prompts = [tok.chat(p) for p in HELD_OUT[: args.prompts]]
    state_file = cache_dir() / "bench-drafts" / f"target-{args.prompts}x{args.new_tokens}.pt"
    if args.reuse and state_file.is_file():
        state = torch.load(state_file)
        print(f"# contexts, target rows and target costs reused from {state_file}")
    else:
        t0 = time.perf_counter()
        twin = load_backend(f"gguf:smollm2?type=q8_0&sessions={max(8, len(prompts))}")
        greedy = continuations(twin, prompts, args.new_tokens, None, eos)
        sampled = continuations(twin, prompts, args.new_tokens, TEMPERATURE_MILLI / 1000, eos)
        twin.close()
        print(f"# continuations in {time.perf_counter() - t0:.0f} s")
        context = (prompts[0] + greedy[0][len(prompts[0]):])[:200]
        state = {
            "greedy": greedy, "sampled": sampled, "context": context,
            "target_argmax": [target_rows(model, s, len(p)).argmax(-1) for s, p in zip(greedy, prompts, strict=True)],
            "p_sampled": [kernels.target_probs(target_rows(model, s, len(p)), TEMPERATURE_MILLI)
                          for s, p in zip(sampled, prompts, strict=True)],
            "t1": target_costs(model, context, 1), "t4": target_costs(model, context, 4),
        }
        ensure_dir(state_file.parent)
        torch.save(state, state_file)
    greedy, sampled, context = state["greedy"], state["sampled"], state["context"]
    p_greedy, p_sampled, t1, t4 = state["target_argmax"], state["p_sampled"], state["t1"], state["t4"]
    print(f"# first greedy reply: {tok.decode(greedy[0][len(prompts[0]):])[:100]!r}")
    print("# target cached forward, ms (1 session / 4 sessions): " + ", ".join(
        f"{n} new: {1e3 * t1[n]:.0f} / {1e3 * t4[n]:.0f}" for n in t1))
    print("| draft | greedy accept, positions 1..5 | greedy tokens/round (M=5) | T=0.7 accept, positions 1..5 | T=0.7 tokens/round (M=5) | ms/step 1 / 4 / 8 sessions | CPU ms/step 1 / 4 / 8 | expected speedup greedy 1 / 4 sessions (M) | T=0.7 1 / 4 sessions (M) |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    for spec in args.drafts.split(","):
        t0 = time.perf_counter()
        backend = load_backend(spec)
        loaded = time.perf_counter() - t0
        assert backend.vocab_size == model.config.vocab_size, "draft and target vocabularies differ"
        m_ok = [(draft_rows(backend, s, len(p)).argmax(-1) == pg)
                for s, p, pg in zip(greedy, prompts, p_greedy, strict=True)]
        a_ok = []
        for s, p, pt in zip(sampled, prompts, p_sampled, strict=True):
            q = kernels.target_probs(draft_rows(backend, s, len(p)), TEMPERATURE_MILLI)
            a_ok.append(torch.minimum(pt, q).sum(-1).clamp(max=1.0))
        g_reach, g_alpha = chain_stats(m_ok, args.max_m)
        s_reach, s_alpha = chain_stats(a_ok, args.max_m)
        (d1, c1), (d4, c4), (d8, c8) = (draft_cost(backend, context, n) for n in (1, 4, 8))
        g1, s1 = best_speedup(g_reach, d1, t1), best_speedup(s_reach, d1, t1)
        g4, s4 = best_speedup(g_reach, d4, t4), best_speedup(s_reach, d4, t4)
        print(f"| `{spec}` | {' '.join(f'{a:.2f}' for a in g_alpha[:5])} | {sum(g_reach[:6]):.2f} "
              f"| {' '.join(f'{a:.2f}' for a in s_alpha[:5])} | {sum(s_reach[:6]):.2f} "
              f"| {1e3 * d1:.1f} / {1e3 * d4:.1f} / {1e3 * d8:.1f} | {1e3 * c1:.1f} / {1e3 * c4:.1f} / {1e3 * c8:.1f} "
              f"| {g1[0]:.2f}x ({g1[1]}) / {g4[0]:.2f}x ({g4[1]}) "
              f"| {s1[0]:.2f}x ({s1[1]}) / {s4[0]:.2f}x ({s4[1]}) |", flush=True)
        print(f"#   {spec}: loaded in {loaded:.1f} s", flush=True)
        summary.append((g1[0], spec, g1, g4, s1, s4, g_alpha[0], s_alpha[0]))
        close = getattr(backend, "close", None)
        if close:
            close()
        del backend
    best = max(summary)
    _, spec, g1, g4, s1, s4, ga, sa = best
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    print(f"best draft {spec}: expected speedup greedy 1 prompt {g1[0]:.2f}x (M={g1[1]}), 4 prompts "
          f"{g4[0]:.2f}x (M={g4[1]}), T=0.7 {s1[0]:.2f}x / {s4[0]:.2f}x; first-token acceptance "
          f"greedy {ga:.2f}, T=0.7 {sa:.2f}")


if __name__ == "__main__":
    main()
