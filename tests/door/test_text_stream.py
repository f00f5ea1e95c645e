"""Text deltas and stop strings on decoded text (router/textstream.py), with the byte
tokenizer of the demo models: multi-byte characters span tokens, so the matching must
work on text, hold back what could still change, and never send text after a stop."""

from __future__ import annotations

import pytest

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
