"""The one front door: a model loaded once, documents turned into caches, questions into answers.

The CLI, the benchmarks and the tests all go through here, so the flow is written once.
"""

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .cache import CompressedCache
from .config import SnapKVConfig
from .documents import Document
from .errors import DocumentError
from .generation import Sampling, answer, prefill
from .models import LoadedModel
from .prompting import context_ids, document_ids, question_ids

# Room left after the document for the question and the answer when checking the context length.
QUESTION_ALLOWANCE = 128


@dataclass
class PreparedDocument:
    """A document's cache, ready for any number of questions."""

    document: Document
    cache: CompressedCache
    prefill_seconds: float

    @property
    def tokens(self) -> int:
        return self.cache.original_length


@dataclass
class AnswerResult:
    question: str
    text: str
    new_tokens: int
    ttft_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


class AnswerStream:
    """Iterate to get the answer's text as it is generated; `result` is set when it ends."""

    def __init__(self, session: "Session", prepared: PreparedDocument, question: str,
                 answer_prefix: str, max_new_tokens: int, sampling: Sampling) -> None:
        self._session = session
        self._prepared = prepared
        self.question = question
        self._answer_prefix = answer_prefix
        self._max_new_tokens = max_new_tokens
        self._sampling = sampling
        self.result: AnswerResult | None = None

    def __iter__(self) -> Iterator[str]:
        loaded = self._session.loaded
        tokenizer = loaded.tokenizer
        ids = question_ids(tokenizer, self.question, self._answer_prefix)
        settings = self._session.settings
        per_question = settings if settings is not None and settings.query_aware else None
        started = time.perf_counter()
        first_token_at = None
        tokens: list[int] = []
        shown = ""
        for token in answer(loaded.model, self._prepared.cache, ids, per_question=per_question,
                            max_new_tokens=self._max_new_tokens, stop_ids=loaded.stop_ids,
                            sampling=self._sampling):
            if first_token_at is None:
                first_token_at = time.perf_counter()
            tokens.append(token)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd") and len(text) > len(shown):  # wait for whole characters
                yield text[len(shown):]
                shown = text
        ended = time.perf_counter()
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if len(text) > len(shown):
            yield text[len(shown):]
        first_token_at = first_token_at or ended
        self.result = AnswerResult(
            question=self.question, text=text, new_tokens=len(tokens),
            ttft_seconds=first_token_at - started, decode_seconds=ended - first_token_at,
        )


class Session:
    """A loaded model and the compression settings (None: keep the full cache, the baseline)."""

    def __init__(self, loaded: LoadedModel, settings: SnapKVConfig | None) -> None:
        self.loaded = loaded
        self.settings = settings

    def prompt_ids(self, document: Document) -> torch.Tensor:
        """(n,) context ids, refused if the model cannot hold them with room for a question."""
        ids = context_ids(self.loaded.tokenizer, document_ids(self.loaded.tokenizer, document.text))
        limit = self.loaded.context_length
        if limit and ids.shape[0] + QUESTION_ALLOWANCE > limit:
            raise DocumentError(
                f"the document is {ids.shape[0]} tokens; {self.loaded.name} holds {limit} tokens, "
                f"and {QUESTION_ALLOWANCE} are kept for the question and answer"
            )
        return ids

    def prepare(self, document: Document) -> PreparedDocument:
        """Prefill the document, compressing as configured."""
        ids = self.prompt_ids(document)
        tier = self.settings.stored_tier if self.settings is not None else None
        started = time.perf_counter()
        cache = prefill(self.loaded.model, ids, tier)
        return PreparedDocument(document, cache, time.perf_counter() - started)

    def ask(self, prepared: PreparedDocument, question: str, *, answer_prefix: str = "",
            max_new_tokens: int = 256, sampling: Sampling = Sampling()) -> AnswerStream:
        return AnswerStream(self, prepared, question, answer_prefix, max_new_tokens, sampling)
