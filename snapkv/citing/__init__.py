"""Citations: the passages of the document an answer drew on, found from where its tokens looked.

    document_passages(...)   the document's sentences, their prompt positions, file, page and line (passages)
    cite(...)                one to three passages for an answer, best first, each with its share of the attention

The answer's tokens are fed once more after the cache (snapkv.citing.attention); the attention the rows that
produced them paid each held position is read at one layer (POOLING: 60% of the model's depth), the most any query
head paid it, summed per passage and shared out over the document. The layer, the heads' pooling and the passages'
were chosen by measurement on the fidelity documents (benchmarks/citation_sweep.py: every layer, every third and
half, heads by mean and max, passages by sum, max and mean; docs/measurements.md).
"""

from dataclasses import asdict, dataclass

import torch

from snapkv.citing.attention import answer_attention
from snapkv.citing.passages import Passage, display_name, document_passages
from snapkv.storage.cache import CompressedCache

MOST_CITED = 3
# A second or third passage is cited where it drew at least this share of the first one's attention.
SECOND_PASSAGE_SHARE = 0.5


@dataclass(frozen=True)
class Pooling:
    """Where the answer's attention is read: one layer, at a share of the model's depth (layer int(depth x layers)),
    and how its query heads pool ("max": the head that looked hardest at a position; "mean")."""

    depth: float = 0.6
    heads: str = "max"

    def layer(self, count: int) -> int:
        return min(int(self.depth * count), count - 1)


POOLING = Pooling()


@dataclass(frozen=True)
class Citation:
    """A passage an answer drew on. score: its share of the answer's attention on the document (0-1)."""

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
    """(passages,) the share of the answer's attention on the document that each passage drew.

    question_ids (q,): the question as it was fed; answer_ids (a,): the answer's tokens. The rows that produced the
    answer are the question's last and each answer token but the last."""
    fed = torch.cat([question_ids, answer_ids[:-1]])  # (q + a - 1,)
    layer = pooling.layer(cache.num_layers)
    by_position = torch.zeros(cache.original_length)  # attention per prompt position, pooled over the heads

    def pool(index: int, summed: torch.Tensor, positions: torch.Tensor) -> None:  # (q_heads, held) each
        per_head = torch.zeros(summed.shape[0], cache.original_length).scatter_(1, positions.cpu(), summed.cpu())
        by_position.copy_(per_head.amax(dim=0) if pooling.heads == "max" else per_head.mean(dim=0))

    answer_attention(model, cache, fed, answer_ids.shape[0], pool, {layer})
    scores = torch.stack([by_position[p.positions.start:p.positions.stop].sum() for p in passages]) if passages \
        else torch.zeros(0)
    document = cache.document
    total = by_position[document.start:document.stop].sum()
    return scores / total if total > 0 else scores


def cite(model, cache: CompressedCache, question_ids: torch.Tensor, answer_ids: torch.Tensor,
         passages: list[Passage], pooling: Pooling = POOLING, most: int = MOST_CITED) -> list[Citation]:
    """The passages the answer drew on, best first: the first, and up to `most` - 1 more that drew at least
    SECOND_PASSAGE_SHARE of its attention. None for an empty answer or a document without passages."""
    if answer_ids.shape[0] == 0 or not passages:
        return []
    scores = passage_scores(model, cache, question_ids, answer_ids, passages, pooling)
    order = scores.argsort(descending=True)[:most].tolist()
    best = float(scores[order[0]])
    cited = [order[0]] + [i for i in order[1:] if float(scores[i]) >= SECOND_PASSAGE_SHARE * best and best > 0]
    return [Citation(passages[i].source, passages[i].page, passages[i].line, passages[i].text,
                     round(float(scores[i]), 4)) for i in cited]


__all__ = ["Citation", "Passage", "Pooling", "POOLING", "cite", "document_passages", "passage_scores"]
