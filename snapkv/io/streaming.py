"""Answer text as its tokens come, without decoding the whole answer again for every token.

Only the last few tokens are decoded per step (the approach of vLLM's incremental detokenizer): the text
of tokens[prefix:read] is known to have been shown, the text of tokens[prefix:] is decoded, and what it adds
is new, unless it ends in an incomplete character (a multi-byte character split over tokens), which waits
for the next token.
"""


class TextStream:
    """Feed token ids with add(); each call returns the new text it completes ("" while a character waits)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # first token of the window decoded each step
        self._read = 0    # tokens whose text has been returned

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        shown = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(self.tokens[self._prefix:])
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return text[len(shown):]
        return ""

    def flush(self) -> str:
        """What is left when the answer ends (an incomplete character, shown as it is)."""
        shown = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(self.tokens[self._prefix:])
        self._prefix = self._read = len(self.tokens)
        return text[len(shown):] if len(text) > len(shown) else ""
