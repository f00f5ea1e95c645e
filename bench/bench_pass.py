"""The verifier's decode pass at load against transformers' own batched step (issue 38):
B sessions of the real target (`hf:smollm2`), one new token each, through the backend's
packed ragged pass (`score`, its linear layers in their measured forms) and as transformers'
bare cached forward over one `DynamicCache` of B rows (what `generate()` runs each step, on a
second copy of the model with transformers' own linear layers),
alternating the two so that load on a shared machine hits both alike.

    .venv/bin/python bench/bench_pass.py [--sessions 1,8,64] [--passes 6] [--threads N]

Both start from the same prompt (about 50 tokens) prefilled once and grow one token per pass.
Times are medians over the passes after the first. Last line:
`pass: B=1 A.AAx ... B=64 C.CCx packed over transformers' batched step (median ms ...)`.
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

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,8,64")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import DynamicCache  # noqa: F401 (the [hf] extra)

    backend = load_backend("hf:smollm2")                        # linear layers measured
    model = load_backend(library_spec("hf:smollm2")).model      # transformers' as shipped
    prompt = backend.encode(PROMPT)
    print(f"bench_pass: hf:smollm2, prompt {len(prompt)} tokens, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    ratios, lines = [], []
    for b in [int(x) for x in args.sessions.split(",")]:
        sids = [n.to_bytes(16, "big") for n in range(b)]
        for sid in sids:
            backend.open(sid, prompt)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt] * b), use_cache=True)   # what generate() holds
            cache = out.past_key_values   # the output field keeps its name
            packed, batched = [], []
            for _ in range(args.passes):
                started = time.perf_counter()
                backend.score([(sid, (17,)) for sid in sids])
                packed.append(time.perf_counter() - started)
                for sid in sids:
                    backend.commit(sid, [17])
                started = time.perf_counter()
                model(input_ids=torch.full((b, 1), 17), cache=cache, use_cache=True)
                batched.append(time.perf_counter() - started)
        for sid in sids:
            backend.release(sid)
        p, q = statistics.median(packed[1:]), statistics.median(batched[1:])
        ratios.append(f"B={b} {p / q:.2f}x")
        lines.append(f"B={b} {1e3 * p:.0f}/{1e3 * q:.0f}")
        print(f"  B={b:>3}: packed pass {1e3 * p:7.1f} ms, transformers' batched step {1e3 * q:7.1f} ms")
    print(f"pass: {' '.join(ratios)} packed over transformers' batched step (median ms {' '.join(lines)})")


if __name__ == "__main__":
    main()
