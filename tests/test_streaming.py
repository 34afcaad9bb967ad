"""Answer text streamed token by token is the text of the whole answer, without decoding it again per token."""

import random

from snapkv.io.streaming import TextStream


def streamed(tokenizer, tokens: list[int]) -> tuple[str, int]:
    stream = TextStream(tokenizer)
    pieces = [stream.add(token) for token in tokens]
    pieces.append(stream.flush())
    return "".join(pieces), max((len(p) for p in pieces), default=0)


def test_streamed_pieces_make_the_whole_text(embedded):
    tokenizer = embedded.tokenizer
    samples = ["The 2023 revenue was £184.6 million — up 52%.", "Ünïcödé ✓ 日本語のテキスト 🚢⚓ end.",
               "  leading spaces\n\nand\tnew lines  "]
    for text in samples:
        tokens = tokenizer(text, add_special_tokens=False).input_ids
        assert streamed(tokenizer, tokens)[0] == tokenizer.decode(tokens, skip_special_tokens=True)
    generator = random.Random(0)
    vocabulary = len(tokenizer)
    for _ in range(20):  # any token sequence, split characters and special tokens included
        tokens = [generator.randrange(vocabulary) for _ in range(generator.randrange(1, 60))]
        assert streamed(tokenizer, tokens)[0] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_each_step_decodes_a_few_tokens_only(embedded):
    """The cost per token does not grow with the answer: each step decodes a window of a few tokens."""
    tokenizer = embedded.tokenizer
    calls = []

    class Counting:
        def decode(self, tokens, **kwargs):
            calls.append(len(tokens))
            return tokenizer.decode(tokens, **kwargs)

    tokens = tokenizer(" word" * 400, add_special_tokens=False).input_ids
    streamed(Counting(), tokens)
    assert max(calls) <= 4
