"""Needle-in-a-haystack documents: filler prose of a chosen token length with one fact inside."""

from dataclasses import dataclass
from functools import cache
from importlib import resources

NEEDLE_TEMPLATE = "The special magic number is {number}."
NEEDLE_QUESTION = "What is the special magic number?"
NEEDLE_ANSWER_PREFIX = "The special magic number is"


@cache
def filler_text() -> str:
    """Plain essays shipped with the package (snapkv/io/data/essays.txt): the prose a haystack is made of."""
    return resources.files("snapkv.io").joinpath("data", "essays.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Haystack:
    text: str
    number: str
    depth: float


def build_haystack(tokenizer, filler: str, tokens: int, depth: float, number: str) -> Haystack:
    """About `tokens` tokens of filler paragraphs (repeated as needed), the needle placed at `depth` (0..1).

    The needle goes between paragraphs, at the paragraph boundary nearest to the requested depth.
    """
    paragraphs = [p.strip() for p in filler.split("\n\n") if p.strip()]
    if not paragraphs:
        raise ValueError("the filler text has no paragraphs")
    lengths = [len(tokenizer(p + "\n\n", add_special_tokens=False).input_ids) for p in paragraphs]
    chosen, total, index = [], 0, 0
    while total < tokens:
        chosen.append(paragraphs[index % len(paragraphs)])
        total += lengths[index % len(paragraphs)]
        index += 1
    insert_at = round(depth * len(chosen))
    chosen.insert(insert_at, NEEDLE_TEMPLATE.format(number=number))
    return Haystack("\n\n".join(chosen), number, depth)
