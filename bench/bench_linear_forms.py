"""The verifier's packed pass with its linear layers in their measured forms (the default
`hf:` backend, models/linear_forms.py) against the same pass with transformers' own
`nn.Linear` (`linear=library`), for the shapes serving runs: B sessions x W new tokens each
(self-decoding steps W = 1, verify passes W = M + 1), alternating the two backends pass by
pass so that load on a shared machine hits both alike.

    .venv/bin/python bench/bench_linear_forms.py [--shapes 1x1,2x1,8x1,64x1,1x6,1x9,8x6] [--passes 12]

Each shape first runs until its row count has chosen a form (the warm-up, not timed), then
`--passes` timed passes of each backend; times are medians. Last line:
`linear forms: 1x1 A.AAx ... measured over library (median ms ...)`, below 1 where the
measured forms are faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.hf import library_spec  # noqa: E402
from sdcp_fast.models.linear_forms import WARMUP, rows_key  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3


def one_pass(backend, sids: list[bytes], w: int, step: int) -> float:
    """Seconds of one packed pass over `w` new tokens for each session, then committed."""
    tokens = tuple(100 + (step + n) % 500 for n in range(w))
    started = time.perf_counter()
    backend.score([(sid, tokens) for sid in sids])
    seconds = time.perf_counter() - started
    for sid in sids:
        backend.commit(sid, list(tokens))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x1,2x1,8x1,64x1,1x6,1x9,8x6", help="BxW: sessions x new tokens each")
    ap.add_argument("--passes", type=int, default=12)
    args = ap.parse_args()
    measured = load_backend("hf:smollm2")
    library = load_backend(library_spec("hf:smollm2"))
    prompt = measured.encode(PROMPT)
    print(f"bench_linear_forms: hf:smollm2, prompt {len(prompt)} tokens, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    ratios, lines = [], []
    for shape in args.shapes.split(","):
        b, w = (int(x) for x in shape.split("x"))
        sids = [n.to_bytes(16, "big") for n in range(b)]
        times: dict[str, list[float]] = {"measured": [], "library": []}
        for be in (measured, library):
            for sid in sids:
                be.open(sid, prompt)
        step = 0
        while rows_key(b * w) not in measured.linear_forms.chosen() and step < 4 * WARMUP + 4:   # the warm-up
            one_pass(measured, sids, w, step)
            one_pass(library, sids, w, step)
            step += 1
        for _ in range(args.passes):
            times["measured"].append(one_pass(measured, sids, w, step))
            times["library"].append(one_pass(library, sids, w, step))
            step += 1
        for be in (measured, library):
            for sid in sids:
                be.release(sid)
        m, q = statistics.median(times["measured"]), statistics.median(times["library"])
        form = measured.linear_forms.chosen().get(rows_key(b * w), "undecided")
        ratios.append(f"{shape} {m / q:.2f}x")
        lines.append(f"{shape} {1e3 * m:.0f}/{1e3 * q:.0f}")
        print(f"  {shape:>5} ({b * w:>3} rows): measured {1e3 * m:7.1f} ms ({form}), library {1e3 * q:7.1f} ms")
    print(f"linear forms: {' '.join(ratios)} measured over library (median ms {' '.join(lines)})")


if __name__ == "__main__":
    main()
