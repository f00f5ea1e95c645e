"""Committed tokens -> text deltas for clients, with stop strings matched on the text.

    stream = TextStream(decode, stop=["\\n\\n"], hidden={eos_id})
    delta = stream.feed(all_tokens_so_far, final=False)   # text safe to send now
    stream.stopped      # the stop string met, or None
    stream.tokens_used  # tokens up to the one that completed the stop string (usage)

Text is decoded incrementally, as text-generation servers do: each feed decodes only the
tokens since the last settled character boundary together with the tokens before them (their
left context), and takes the new text as the difference between the two decodings. So a
tokenizer whose pieces depend on what precedes them (a leading space dropped at the start of
a decoding, bytes that only make a character together) comes out as its decoding of the whole
sequence, and a token costs the same at the thousandth token as at the first (decoding the
whole sequence at each token would make a stream's cost quadratic in its length, and the
router feeds every committed token of every stream). Held back until more tokens come: a
trailing incomplete character (U+FFFD), and a suffix that could still become a stop string
("\\n" while "\\n\\n" is a stop string), so text after a stop string is never sent and
a stop string split across tokens is still found. Tokens in `hidden` (end-of-sequence tokens, which stop
the generation at the verifier) are left out of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], *, stop: Sequence[str] = (),
                 hidden: Collection[int] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.hidden = set(hidden)
        self.sent = ""                  # text sent so far
        self.stopped: str | None = None
        self.tokens_used: int | None = None   # set when a stop string ended the text
        self.fed = 0                    # tokens taken from the sequence so far
        self.visible: list[int] = []    # ... less the hidden ones
        self.text = ""                  # the decoding of visible[:settled]
        self.context = 0                # visible[context:settled]: the left context of the next decoding
        self.settled = 0                # visible[:settled] ends on a character boundary

    def text_of(self, tokens: Sequence[int]) -> str:
        return self.decode([t for t in tokens if t not in self.hidden])

    def feed(self, tokens: Sequence[int], *, final: bool = False) -> str:
        """The text to send after `tokens` (every token so far, the earlier ones as fed
        before); "" once stopped."""
        if self.stopped is not None:
            return ""
        text = self._decoded(tokens, final)
        if not text.startswith(self.sent):
            # the tokenizer re-read an earlier piece differently: send only once it settles
            return ""
        cut = self._first_stop(text)
        if cut is not None:
            end, self.stopped = cut
            self.tokens_used = self._tokens_to(tokens, end + len(self.stopped))
            return self._advance(text[:end])
        if not final:
            text = text[:len(text) - self._partial_stop(text)]
        return self._advance(text)

    def _decoded(self, tokens: Sequence[int], final: bool) -> str:
        """The text of every visible token, less a trailing incomplete character unless final."""
        self.visible.extend(t for t in tokens[self.fed:] if t not in self.hidden)
        self.fed = len(tokens)
        if self.settled == len(self.visible):
            return self.text
        before = self.decode(self.visible[self.context:self.settled]) if self.settled > self.context else ""
        after = self.decode(self.visible[self.context:])
        if after.endswith("\ufffd") and not final:
            return self.text + after[len(before):-1] if after.startswith(before) else self.text
        if len(after) < len(before) or not after.startswith(before):
            # the new tokens changed the context's own text: decode the whole (rare)
            self.text = self.decode(self.visible)
        else:
            self.text += after[len(before):]
        self.context, self.settled = self.settled, len(self.visible)
        return self.text

    def _advance(self, text: str) -> str:
        delta = text[len(self.sent):] if len(text) > len(self.sent) else ""
        self.sent = max(self.sent, text, key=len)
        return delta

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in the text not yet sent."""
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, len(self.sent) - longest + 1)
        found = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _partial_stop(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _tokens_to(self, tokens: Sequence[int], chars: int) -> int:
        """The fewest tokens whose text holds the first `chars` characters (a character still
        incomplete decodes as U+FFFD: it does not count yet); the text's length only grows
        with the tokens, so a bisection."""
        def holds(n: int) -> bool:
            return len(self.text_of(tokens[:n]).rstrip("\ufffd")) >= chars
        lo, hi = 0, len(tokens)               # holds(hi) or hi is every token
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if holds(mid):
                hi = mid
            else:
                lo = mid
        return hi
