"""Citations: the passages of the document an answer drew on, found from where its tokens looked.

    document_passages(...)   the document's sentences, their prompt positions, file, page and line (passages)
    cite(...)                one to three passages for an answer, best first, each with its share of the attention

The answer's tokens are fed once more after the cache (snapkv.citing.attention); the attention the rows that
produced them paid each held position is read at one full-attention layer (POOLING: 60% of the model's depth) and
summed per passage and per query head; a passage scores what the head that paid it most paid it, as a share of the
rows' attention. The layer, the heads' pooling and the passages' were chosen by measurement on the fidelity
documents (benchmarks/citations.py sweep: every layer, every third and half, heads by mean and max, passages by sum,
max and mean; docs/measurements.md).
"""

from dataclasses import asdict, dataclass

import torch

from snapkv.citing.attention import answer_attention
from snapkv.citing.passages import Passage, display_name, document_passages
from snapkv.modeling.architectures import attention_layers
from snapkv.storage.cache import CompressedCache

MOST_CITED = 3
# A second or third passage is cited where it drew at least this share of the first one's attention.
SECOND_PASSAGE_SHARE = 0.5


@dataclass(frozen=True)
class Pooling:
    """Where the answer's attention is read: the full-attention layer nearest a share of the model's depth (layer
    int(depth x layers)), and how its query heads pool a passage's attention ("max": the head that paid the passage
    most; "mean")."""

    depth: float = 0.6
    heads: str = "max"

    def layer(self, full_attention: list[int], count: int) -> int:
        """The layer to read among the full-attention ones (a sliding window's holds too little to cite from)."""
        aimed = min(int(self.depth * count), count - 1)
        return min(full_attention, key=lambda index: (abs(index - aimed), index))


POOLING = Pooling()


@dataclass(frozen=True)
class Citation:
    """A passage an answer drew on. score: its share of the attention the answer's tokens paid, at the head that paid
    it most (0-1; the rest went to other passages, the prompt's template, the question and the answer itself)."""

    source: str | None
    page: int | None
    line: int | None
    text: str
    score: float

    def to_dict(self) -> dict:
        return asdict(self)

    def where(self) -> str:
        """"annual_report.pdf, page 2, line 7" as a reader is told it."""
        parts = [display_name(self.source)]
        if self.page is not None:
            parts.append(f"page {self.page}")
        if self.line is not None:
            parts.append(f"line {self.line}")
        return ", ".join(parts)


def passage_scores(model, cache: CompressedCache, question_ids: torch.Tensor, answer_ids: torch.Tensor,
                   passages: list[Passage], pooling: Pooling = POOLING) -> torch.Tensor:
    """(passages,) each passage's share of the attention the answer's rows paid, at the head that paid it most (or
    the heads' mean): 0 to 1.

    question_ids (q,): the question as it was fed; answer_ids (a,): the answer's tokens. The rows that produced the
    answer are the question's last and each answer token but the last."""
    fed = torch.cat([question_ids, answer_ids[:-1]])  # (q + a - 1,)
    full_attention = [layer.index for layer in attention_layers(model) if layer.compressible]
    layer = pooling.layer(full_attention, cache.num_layers)
    starts = torch.tensor([p.positions.start for p in passages])
    stops = torch.tensor([p.positions.stop for p in passages])
    scores = torch.zeros(len(passages))

    def pool(index: int, summed: torch.Tensor, positions: torch.Tensor) -> None:  # (q_heads, held) each
        per_head = torch.zeros(summed.shape[0], cache.original_length + 1)  # a zero column first, for the sums below
        per_head[:, 1:].scatter_(1, positions.cpu(), summed.cpu())
        running = per_head.cumsum(dim=1)  # running[:, i]: attention on positions before i
        by_passage = running[:, stops] - running[:, starts]  # (q_heads, passages)
        pooled = by_passage.amax(dim=0) if pooling.heads == "max" else by_passage.mean(dim=0)
        scores.copy_(pooled / answer_ids.shape[0])  # each row's attention adds up to 1

    answer_attention(model, cache, fed, answer_ids.shape[0], pool, {layer})
    return scores


def cite(model, cache: CompressedCache, question_ids: torch.Tensor, answer_ids: torch.Tensor,
         passages: list[Passage], pooling: Pooling = POOLING, most: int = MOST_CITED) -> list[Citation]:
    """The passages the answer drew on, best first: the first, and up to `most` - 1 more that drew at least
    SECOND_PASSAGE_SHARE of its attention. None for an empty answer or a document without passages."""
    if answer_ids.shape[0] == 0 or not passages:
        return []
    scores = passage_scores(model, cache, question_ids, answer_ids, passages, pooling)
    order = scores.argsort(descending=True)[:most].tolist()
    best = float(scores[order[0]])
    if best <= 0:  # the answer paid the document nothing that was held
        return []
    cited = [order[0]] + [i for i in order[1:] if float(scores[i]) >= SECOND_PASSAGE_SHARE * best]
    return [Citation(passages[i].source, passages[i].page, passages[i].line, passages[i].text,
                     round(float(scores[i]), 4)) for i in cited]


__all__ = ["Citation", "Passage", "Pooling", "POOLING", "cite", "document_passages", "passage_scores"]
