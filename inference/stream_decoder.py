"""Token ids to text deltas as they stream: what a page or an API client is shown while a model decodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.tokenizer import Tokenizer


class StreamDecoder:
    """Turns a stream of token ids into text deltas whose concatenation is what `decode` makes of the context
    and the tokens together, past the context's own text.

    Decoding token by token breaks three things: a character spread over several byte tokens (decoded alone,
    each gives U+FFFD), SentencePiece's "▁word", whose space is stripped at the start of a decode, and byte
    fallback, which decodes a run of byte tokens ("<0xF0>") as a whole: as UTF-8, or as one U+FFFD per byte
    when the run is not valid UTF-8, the characters it already held included. So each push decodes a short
    window of recent tokens and emits what grew past the text already emitted, holding back a trailing U+FFFD
    (an unfinished character) until the next token completes it and a run of byte tokens until a token that is
    not one ends it; `flush` gives up on both, as `decode` would."""

    WINDOW = 6  # tokens kept before the new ones: more than a 4-byte character needs

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()):
        self._decode = tokenizer.decode
        self._bytes = tokenizer.byte_fallback_ids
        self._skipped = tokenizer.special_ids  # decode leaves them out: a run of bytes goes on past them
        context = list(context_ids)
        start = max(len(context) - self.WINDOW, 0)
        if start:
            start = self._cut(context, self._decode(context), range(start, max(start - 64, 0), -1))
        self._ids = context[start:]  # the window and the tokens since
        self._emitted = len(self._decode(self._ids))  # chars of decode(self._ids) already emitted
        text_ids = [i for i in self._ids if i not in self._skipped]
        self._in_run = bool(text_ids) and text_ids[-1] in self._bytes  # the window ends in byte tokens

    def _cut(self, ids: list[int], text: str, candidates) -> int:
        """The first of `candidates` where a window of `ids` (whose decode is `text`) may start, else 0: where
        no run of byte tokens is cut, whose decode is the end of `text`, with no broken character first. What
        any later token adds to the decode is then the same after that window as after all of `ids`."""
        for cut in candidates:
            if ids[cut] in self._bytes or ids[cut] in self._skipped:
                continue
            tail = self._decode(ids[cut:])
            if text.endswith(tail) and not tail.startswith("\ufffd"):
                return cut
        return 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if token_id not in self._skipped:
            self._in_run = token_id in self._bytes
        if self._in_run:  # a later byte may yet make the whole run U+FFFD: nothing of it is final
            return ""
        text = self._decode(self._ids)
        ready = len(text.rstrip("\ufffd"))
        delta = text[self._emitted : ready] if ready > self._emitted else ""
        self._emitted = max(self._emitted, ready)
        n = len(self._ids)
        if self._emitted == len(text) and n > 2 * self.WINDOW:
            # All emitted and complete: slide the window so each push decodes a bounded number of tokens,
            # keeping WINDOW tokens or up to twice that, else fewer, where the window may start.
            candidates = [
                *range(n - self.WINDOW, n - 2 * self.WINDOW - 1, -1),
                *range(n - self.WINDOW + 1, n),
            ]
            cut = self._cut(self._ids, text, candidates)
            if cut:
                self._ids = self._ids[cut:]
                self._emitted = len(self._decode(self._ids))
        return delta

    def flush(self) -> str:
        """The text held back (an unfinished character or run of bytes, as `decode` shows them)."""
        text = self._decode(self._ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        self._in_run = False
        return delta
