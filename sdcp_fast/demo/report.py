"""The demo's report: the texts, a table per prompt against the target alone, the totals,
and with --plot a PNG of accepted tokens and m_cap per round (needs matplotlib)."""

from __future__ import annotations

import sys

from .baseline import Baseline
from .client import Generation

ESCALATIONS = ("reduce", "switch", "self_decode", "fail")


def print_texts(generations: list[Generation], backend) -> None:
    for n, g in enumerate(generations):
        print(f"\n--- [{n + 1}] {g.finish or g.error} ---")
        print(g.prompt + "\x1b[1m" + backend.decode(g.tokens) + "\x1b[0m" if sys.stdout.isatty()
              else g.prompt + backend.decode(g.tokens))


def summarize(records: list[dict]) -> dict:
    """Per-round statistics of one or more sessions (drafters' round records)."""
    rounds = len(records)
    proposed = sum(r["m"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    emitted = sum(r["emitted"] for r in records)
    escalations = sum(1 for r in records if r["action"] in ESCALATIONS)
    return {"rounds": rounds, "accepted_per_round": accepted / rounds if rounds else 0.0,
            "tokens_per_round": emitted / rounds if rounds else 0.0,
            "acceptance": accepted / proposed if proposed else 0.0, "escalations": escalations}


def per_prompt(generations, records: list[dict], outputs, seconds) -> list[tuple]:
    """(number, generation, its rounds' `summarize`, whether its tokens equal `outputs[n]`,
    its tokens/s, the reference's tokens/s from `seconds[n]`) for each prompt."""
    by_session: dict[str, list[dict]] = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    rows = []
    for n, g in enumerate(generations):
        rate = len(g.tokens) / g.seconds if g.seconds else 0.0
        alone = len(outputs[n]) / seconds[n] if seconds[n] else 0.0
        rows.append((n + 1, g, summarize(by_session.get(g.gid, [])), g.tokens == outputs[n], rate, alone))
    return rows


def print_table(generations, records, wall, baseline: Baseline) -> dict:
    header = (f"{'prompt':>6} {'tokens':>6} {'rounds':>6} {'acc/rnd':>7} {'tok/pass':>8} {'accept':>6} "
              f"{'escal':>5} {'SDCP tok/s':>10} {'alone tok/s':>11} {'speedup':>7} {'same':>5}")
    print("\n" + header)
    print("-" * len(header))
    rows = per_prompt(generations, records, baseline.outputs, baseline.each_s)
    identical = sum(row[3] for row in rows)
    for n, g, stats, same, rate, alone in rows:
        print(f"{n:>6} {len(g.tokens):>6} {stats['rounds']:>6} {stats['accepted_per_round']:>7.2f} "
              f"{stats['tokens_per_round']:>8.2f} {stats['acceptance']:>6.0%} {stats['escalations']:>5} "
              f"{rate:>10.1f} {alone:>11.1f} {rate / alone if alone else 0:>6.2f}x {'yes' if same else 'NO':>5}")
    total = summarize(records)
    tokens = sum(len(g.tokens) for g in generations)
    sdcp_rate = tokens / wall if wall else 0.0
    batched_rate = baseline.tokens / baseline.batched_s if baseline.batched_s else 0.0
    each_rate = baseline.tokens / sum(baseline.each_s) if sum(baseline.each_s) else 0.0
    print("-" * len(header))
    print(f"{'all':>6} {tokens:>6} {total['rounds']:>6} {total['accepted_per_round']:>7.2f} "
          f"{total['tokens_per_round']:>8.2f} {total['acceptance']:>6.0%} {total['escalations']:>5} "
          f"{sdcp_rate:>10.1f} {batched_rate:>11.1f} {sdcp_rate / batched_rate if batched_rate else 0:>6.2f}x "
          f"{identical}/{len(generations)}")
    self_decoded = tokens - sum(r["emitted"] for r in records)
    passes = 1 / total["tokens_per_round"] if total["tokens_per_round"] else 1.0
    print(f"\nSDCP, {len(generations)} prompts at once (router, verifier, 2 drafters):   "
          f"{tokens} tokens in {wall:.2f} s = {sdcp_rate:.1f} tokens/s")
    print(f"target alone, prompts batched in each pass:             "
          f"{baseline.tokens} tokens in {baseline.batched_s:.2f} s = {batched_rate:.1f} tokens/s")
    print(f"target alone, one prompt at a time:                     "
          f"{baseline.tokens} tokens in {sum(baseline.each_s):.2f} s = {each_rate:.1f} tokens/s")
    print(f"speedup (wall clock, all prompts): {sdcp_rate / batched_rate if batched_rate else 0:.2f}x "
          f"over batched, {sdcp_rate / each_rate if each_rate else 0:.2f}x over one at a time")
    print(f"target passes per token: {passes:.2f} (target alone: 1.00); escalations: "
          f"{total['escalations']}; tokens the verifier decoded itself: {self_decoded}")
    print(f"outputs identical to the target's greedy decoding: {identical}/{len(generations)} "
          "(rule 1: they must all be)")
    return {"tokens": tokens, "wall_s": wall, "sdcp_tokens_per_s": sdcp_rate,
            "alone_tokens_per_s": batched_rate, "alone_each_tokens_per_s": each_rate,
            "speedup": sdcp_rate / batched_rate if batched_rate else 0.0,
            "speedup_each": sdcp_rate / each_rate if each_rate else 0.0,
            "tokens_per_round": total["tokens_per_round"], "accepted_per_round": total["accepted_per_round"],
            "acceptance": total["acceptance"], "escalations": total["escalations"],
            "self_decoded": self_decoded, "identical": identical, "rounds": total["rounds"]}


def plot(path: str, records: list[dict], generations: list[Generation]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n--plot: matplotlib is not installed (pip install matplotlib); no plot written")
        return
    fig, axes = plt.subplots(len(generations), 1, figsize=(9, 2.2 * len(generations)), squeeze=False)
    for n, g in enumerate(generations):
        mine = [r for r in records if r["session"] == g.gid]
        ax = axes[n][0]
        ax.bar([r["round"] for r in mine], [r["accepted"] for r in mine], color="tab:blue", label="accepted")
        ax.step([r["round"] for r in mine], [r["m_cap"] for r in mine], where="mid", color="tab:red",
                label="m_cap")
        ax.set_ylabel(f"[{n + 1}]")
        if n == 0:
            ax.legend(loc="upper right")
    axes[-1][0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nplot written to {path}")
