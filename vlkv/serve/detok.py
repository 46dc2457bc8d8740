"""Incremental detokenization: decode the token list so far and emit the new, settled suffix.

A trailing U+FFFD may be the first bytes of a character the next token completes, so it is held
back until a real character follows it (from then on those bytes cannot decode differently: UTF-8
is decoded left to right). Text that a longer decode rewrites is held too. :meth:`finish` emits the
rest, so the concatenated deltas equal ``tokenizer.decode(all tokens)`` exactly.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> str:
        """Append ``tokens``; return the text that became settled (possibly "")."""
        self.tokens.extend(tokens)
        text = self._text().rstrip(REPLACEMENT)
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def finish(self) -> str:
        """The rest of the text; the emitted deltas then add up to the full decode."""
        text = self._text()
        if not text.startswith(self.emitted):  # cannot happen with a prefix-stable decoder
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    @property
    def text(self) -> str:
        return self._text()
