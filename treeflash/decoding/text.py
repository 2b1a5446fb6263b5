"""Token ids -> text, for streaming: stop tokens hidden, incomplete UTF-8 and possible stop-string
starts held back. The decoding sequence feeds each token it emits (`feed`: a stop string ends it
there, `sequence.Sequence.emit`); readers take the text (`take`). `pieces` is the one loop from a
generation's tokens to its text: the engine's `stream`/`generate` run it."""
from __future__ import annotations

from typing import Iterator


def pieces(tokens: Iterator[int], text: "TextAssembler", ids: list[int] | None = None) -> Iterator[str]:
    """Text pieces of the generation `tokens` (a generator decoding with `text`, e.g.
    `Engine.tokens(..., text=text)`: it feeds `text` every token), taken from `text` as each token
    arrives. `ids` (if given) receives every token id, stop tokens too. Decoding stops
    (`tokens.close()`) at a stop string or when this generator is closed; the held-back tail comes
    last."""
    try:
        for t in tokens:
            if ids is not None:
                ids.append(t)
            piece = text.take()
            if piece:
                yield piece
            if text.stopped:
                return
    finally:
        tokens.close()  # a stop string, an early end or close: stop decoding now
    tail = text.flush()
    if tail:
        yield tail


class TextAssembler:
    """Token ids -> text pieces; holds back text that could be the start of a stop string."""

    def __init__(self, tokenizer, stop_ids: set[int], stops: list[str]):
        self.tokenizer, self.stop_ids, self.stops = tokenizer, stop_ids, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""   # decoded so far
        self.sent = ""   # the prefix of `text` already handed out
        self.stopped = False
        self.cut = 0     # where the first stop string starts in `text`, once `stopped`
        self.ready = ""  # text fed but not yet taken

    def feed(self, token: int) -> bool:
        """Add a token's text for `take`; True once a stop string has appeared (it ends there)."""
        self.ready += self.add(token)
        return self.stopped

    def take(self) -> str:
        """The text fed since the last take (maybe "")."""
        piece, self.ready = self.ready, ""
        return piece

    def add(self, token: int) -> str:
        """Returns the new text to send (maybe ""); sets `stopped` when a stop string appears."""
        if token in self.stop_ids:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.text = text
        cut = self._first_stop(max(0, len(self.sent) - self.hold))
        if cut is not None:
            self.stopped, self.cut = True, cut
            return self._advance(cut)
        return self._advance(len(text) - self.hold)

    def flush(self) -> str:
        """The held-back tail once generation ends (nothing after a stop string)."""
        if self.stopped:
            return ""
        if self.ids and not self.text:  # only an incomplete UTF-8 tail was seen
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._advance(len(self.text))

    def final_text(self) -> str:
        """The whole answer: everything before the stop string, or every token decoded at once."""
        if self.stopped:
            return self.text[:self.cut]
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _first_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _advance(self, end: int) -> str:
        if end <= len(self.sent):
            return ""
        piece = self.text[len(self.sent):end]
        self.sent += piece
        return piece
