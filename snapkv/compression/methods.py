"""Compression methods: which of a layer's cached positions are worth keeping.

A method is a small frozen dataclass with a name and a pure scoring function over the observation
window's queries and the layer's keys (higher is kept). The layer hook, the file metadata, the store
key, `info`, bench and eval take a method by name (`method_from_dict`) and never branch on which one
it is beyond that.

Where the window's queries come from is the method's other half:
- SnapKV scores during the prefill, with the prompt's own tail as the window (`scores_during_prefill`),
  and per question, with the question as the window.
- The stored-tier methods score a whole prompt's cache after the prefill with `probes`: token ids fed
  after the prompt with the cache attached, whose queries are the window. Reconstruction (KVzip's idea)
  feeds "repeat the document" and the document itself, chunk by chunk; PseudoQuestion feeds one generic
  question; KeyNorm feeds nothing and scores the keys alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Literal, Protocol

from snapkv.base.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where tensors are used, so that settings load without it
    import torch

Pooling = Literal["max", "avg"]


@dataclass(frozen=True)
class Probe:
    """Token ids fed after a prompt, with its cache attached, whose queries score some of the cached keys.

    ids:    (p,) token ids, placed at positions original_length.. as a question would be
    scored: the cached positions this probe scores
    sinks:  cached positions its softmax also runs over (always kept; not scored here)
    """

    ids: torch.Tensor
    scored: range
    sinks: range = range(0)


class WindowAttention:
    """What a method scores a layer's keys from, in one value whichever of it the method needs: the keys, the
    observation window's queries, and the attention the window paid the keys before it where the layer's attention
    already computed it.

    keys:    (batch, kv_heads, n, head_dim) after RoPE, the window's own keys last
    scaling: the attention's scale of a query-key product
    window:  w, the window's queries (0: none, for a method that scores the keys alone)
    queries: (batch, q_heads, w, head_dim) after RoPE, or a function that makes them (called once, where needed)
    weights: (batch, kv_heads, group, w, n - w): the window's softmax over all n keys as attention computed it, for
             the keys before the window; or
    sums:    (batch, kv_heads, group, n - w): those weights already summed over the window's queries (the C attention's)
    """

    def __init__(self, keys: torch.Tensor, scaling: float = 1.0, window: int | None = None,
                 queries: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                 weights: torch.Tensor | None = None, sums: torch.Tensor | None = None) -> None:
        self.keys, self.scaling = keys, scaling
        made = queries is None or callable(queries)
        self.window = window if window is not None else 0 if queries is None else queries.shape[2]
        self._queries, self._make_queries = (None, queries) if made else (queries, None)
        self._weights, self._sums = weights, sums

    def queries(self) -> torch.Tensor:
        """(batch, q_heads, w, head_dim)."""
        if self._queries is None:
            self._queries = self._make_queries()
        return self._queries

    def weights(self) -> torch.Tensor:
        """(batch, kv_heads, group, w, n - w): the window's softmax rows onto the keys before it, as attention computed
        them, else from the queries (snapkv.compression.scoring.window_attention_weights); where attention summed them
        over the window already, that sum as the one row (batch, kv_heads, group, 1, n - w)."""
        if self._sums is not None:
            return self._sums.unsqueeze(-2)
        if self._weights is None:
            from snapkv.compression.scoring import window_attention_weights

            self._weights = window_attention_weights(self.queries(), self.keys, self.scaling)
        return self._weights


class Method(Protocol):
    name: ClassVar[str]
    scores_during_prefill: ClassVar[bool]

    def score(self, attention: WindowAttention) -> torch.Tensor:
        """(batch, kv_heads, n - w) scores of the keys before the window (higher is kept)."""
        ...

    def probes(self, prompter, context_ids: torch.Tensor, document: range) -> list[Probe]:
        """What to feed after a prompt (context_ids, the document's positions in it) to score its cache."""
        ...


@dataclass(frozen=True)
class SnapKV:
    """arXiv 2404.14469: the attention the window pays each earlier key, pooled, averaged per GQA group.

    kernel:  width of the 1-D pooling over the scores (odd), so that clusters (a number's digits) survive.
    pooling: "max" or "avg".
    """

    name: ClassVar[str] = "snapkv"
    scores_during_prefill: ClassVar[bool] = True
    kernel: int = 15
    pooling: Pooling = "max"

    def __post_init__(self) -> None:
        _check_pooling(self.kernel, self.pooling)

    def score(self, attention: WindowAttention) -> torch.Tensor:
        """The window's attention weights summed over its queries, pooled, averaged per KV head."""
        from snapkv.compression.scoring import pooled_window_scores

        return pooled_window_scores(attention.weights(), self.kernel, self.pooling)

    def probes(self, prompter, context_ids: torch.Tensor, document: range) -> list[Probe]:
        raise ConfigError("snapkv scores during the prefill, with the prompt's tail as its window")


@dataclass(frozen=True)
class Chunks:
    """Whole chunks kept or dropped together (ChunkKV, arXiv 2502.00299): SnapKV's pooled scores averaged over
    fixed chunks of `size` positions (counted from the prompt's start), so a number, a name or a short phrase is
    kept whole or not at all rather than losing a digit.

    size:    positions per chunk (1: SnapKV itself).
    kernel, pooling: SnapKV's pooling before the chunks are averaged.
    """

    name: ClassVar[str] = "chunks"
    scores_during_prefill: ClassVar[bool] = True
    size: int = 8
    kernel: int = 15
    pooling: Pooling = "max"

    def __post_init__(self) -> None:
        _check_pooling(self.kernel, self.pooling)
        if self.size < 1:
            raise ConfigError(f"a chunk holds at least 1 position, got {self.size}")

    def score(self, attention: WindowAttention) -> torch.Tensor:
        """SnapKV's scores, each position given its chunk's mean."""
        from snapkv.compression.scoring import chunk_means

        return chunk_means(SnapKV(self.kernel, self.pooling).score(attention), self.size)

    def probes(self, prompter, context_ids: torch.Tensor, document: range) -> list[Probe]:
        raise ConfigError("chunks scores during the prefill, with the prompt's tail as its window")


def _check_pooling(kernel: int, pooling: str) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise ConfigError(f"kernel must be an odd number >= 1, got {kernel}")
    if pooling not in ("max", "avg"):
        raise ConfigError(f"pooling must be 'max' or 'avg', got {pooling!r}")


REPEAT_FIRST = " Repeat the document above exactly."
REPEAT_NEXT = " Repeat the part of the document above exactly, starting with"


@dataclass(frozen=True)
class Reconstruction:
    """KVzip's idea (arXiv 2505.23416): keep what the model needs to reproduce the document.

    The document is fed again after the prompt, `chunk` tokens at a time, as the answer to "repeat the
    document above exactly" (later chunks start from the last `overlap` tokens of the one before); a key
    scores the most attention any of those queries, of any head in its group, pays it, the softmax
    running over the template's head (sinks), the chunk's own original keys and the probe's keys.
    kernel: max-pooling width over the scores (1: none), so that a whole number stays together.
    """

    name: ClassVar[str] = "reconstruction"
    scores_during_prefill: ClassVar[bool] = False
    chunk: int = 512
    overlap: int = 8
    kernel: int = 1

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.overlap < 0:
            raise ConfigError(f"reconstruction needs a positive chunk and overlap, got {self.chunk}, {self.overlap}")
        _check_pooling(self.kernel, "max")

    def score(self, attention: WindowAttention) -> torch.Tensor:
        from snapkv.compression.scoring import peak_attention_scores, pool_scores

        scores = peak_attention_scores(attention.queries(), attention.keys, attention.scaling)  # (batch, kv_heads, n - w)
        return pool_scores(scores, self.kernel, "max")

    def probes(self, prompter, context_ids: torch.Tensor, document: range) -> list[Probe]:
        import torch

        found = []
        sinks = range(0, document.start)
        for start in range(document.start, document.stop, self.chunk):
            stop = min(start + self.chunk, document.stop)
            if start == document.start:
                instruction = prompter.plain_ids(REPEAT_FIRST)
            else:
                instruction = prompter.plain_ids(REPEAT_NEXT) + context_ids[max(start - self.overlap, 0):start].tolist()
            ids = instruction + prompter.tail_ids + context_ids[start:stop].tolist()
            found.append(Probe(torch.tensor(ids, dtype=torch.long), range(start, stop), sinks))
        return found


PSEUDO_QUESTIONS = ("What names, numbers, dates and facts does the document give?",)


@dataclass(frozen=True)
class PseudoQuestion:
    """SnapKV with stand-ins for the questions to come as windows, asked once after the prefill: generic
    questions, and the document's own tail re-read (`tail` tokens: what SnapKV's document window sees). Each
    probe's scores are its mean attention per query, so that probes of different lengths compare; a
    position keeps the best score any probe gave it."""

    name: ClassVar[str] = "pseudo-question"
    scores_during_prefill: ClassVar[bool] = False
    questions: tuple[str, ...] = PSEUDO_QUESTIONS
    tail: int = 32
    kernel: int = 15
    pooling: Pooling = "max"

    def __post_init__(self) -> None:
        _check_pooling(self.kernel, self.pooling)
        object.__setattr__(self, "questions", tuple(self.questions))  # a list from JSON metadata too
        if not self.questions and self.tail < 1:
            raise ConfigError("pseudo-question needs a question or a tail to read")

    def score(self, attention: WindowAttention) -> torch.Tensor:
        scores = SnapKV(self.kernel, self.pooling).score(attention)
        return scores / attention.window

    def probes(self, prompter, context_ids: torch.Tensor, document: range) -> list[Probe]:
        everything = range(0, len(context_ids))
        found = [Probe(prompter.question_ids(question), everything) for question in self.questions]
        if self.tail:
            found.append(Probe(context_ids[-self.tail:], everything))
        return found


@dataclass(frozen=True)
class KeyNorm:
    """Keep the keys of smallest L2 norm (kvpress's KnormPress): no forward pass at all, the cheapest."""

    name: ClassVar[str] = "key-norm"
    scores_during_prefill: ClassVar[bool] = False

    def score(self, attention: WindowAttention) -> torch.Tensor:
        from snapkv.compression.scoring import key_norms

        return -key_norms(attention.keys)  # (batch, kv_heads, n): a window of none

    def probes(self, prompter, context_ids: torch.Tensor, document: range) -> list[Probe]:
        return []


METHODS: dict[str, type] = {method.name: method for method in (SnapKV, Chunks, Reconstruction, PseudoQuestion, KeyNorm)}


def method_to_dict(method: Method) -> dict:
    """{"method": name, **its settings}: what file metadata, store keys and reports record."""
    return {"method": method.name, **asdict(method)}


def method_from_dict(data: dict) -> Method:
    """The method a dict from method_to_dict names, with its settings; ConfigError for an unknown one."""
    settings = dict(data)
    name = settings.pop("method", None)
    if name not in METHODS:
        raise ConfigError(f"unknown compression method {name!r}; known: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**settings)
    except TypeError as error:
        raise ConfigError(f"settings of method {name!r} not understood: {error}") from error
