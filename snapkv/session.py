"""The one front door: a model loaded once, documents turned into caches, questions into answers.

The CLI, the benchmarks and the tests all go through here, so the flow is written once.
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from .cache import CompressedCache
from .config import SnapKVConfig
from .documents import Document, stale_sources
from .errors import CacheFileError, ConfigError, DocumentError, OutOfMemoryError, StorageError
from .generation import Sampling, answer, prefill
from .memory import PeakMemory, check_prefill_fits, is_out_of_memory, release_device_memory
from .models import LoadedModel
from .prompting import context_ids, document_ids, question_ids
from .store import CacheStore, cache_key, load_cache, recorded_sources, save_cache

# Room left after the document for the question and the answer when checking the context length.
QUESTION_ALLOWANCE = 128


@dataclass
class PreparedDocument:
    """A document's cache, ready for any number of questions, and how it was obtained."""

    document: Document
    cache: CompressedCache
    prefill_seconds: float = 0.0     # 0 when the cache came from a file
    path: Path | None = None         # the saved cache file, if any
    hit: bool = False                # True when the cache was loaded instead of prefilled
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    file_bytes: int = 0
    note: str = ""                   # something the user should hear about, e.g. a damaged entry rebuilt
    prefill_peak_bytes: int = 0      # PeakMemory of the prefill (0 when loaded from a file)

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
    peak_bytes: int = 0  # PeakMemory of the answer: question pass and decoding

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
        max_new_tokens = self._max_new_tokens
        if loaded.context_length:  # never decode past the positions the model was trained for
            room = loaded.context_length - self._prepared.cache.original_length - ids.shape[0]
            if room < 1:
                raise DocumentError(
                    f"the question ({ids.shape[0]} tokens) does not fit after the {self._prepared.cache.original_length}-"
                    f"token document in {loaded.name}'s {loaded.context_length} positions; ask a shorter question"
                )
            max_new_tokens = min(max_new_tokens, room)
        started = time.perf_counter()
        first_token_at = None
        tokens: list[int] = []
        shown = ""
        with PeakMemory(loaded.device) as memory:
            for token in answer(loaded.model, self._prepared.cache, ids, per_question=per_question,
                                max_new_tokens=max_new_tokens, stop_ids=loaded.stop_ids,
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
            ttft_seconds=first_token_at - started, decode_seconds=ended - first_token_at, peak_bytes=memory.peak,
        )


def stored_settings(settings: SnapKVConfig | None) -> dict | None:
    """What the saved tier is: None for the whole cache, else the compression applied at prefill."""
    tier = settings.stored_tier if settings is not None else None
    if tier is None:
        return None
    return {"budget": tier.budget, "window": tier.window, "kernel": tier.kernel, "pooling": tier.pooling}


class Session:
    """A loaded model, the compression settings (None: keep the full cache, the baseline) and a store.

    store: where caches are looked up and saved (None: neither; every document is prefilled).
    verify: check each loaded cache's payload digest.
    """

    def __init__(self, loaded: LoadedModel, settings: SnapKVConfig | None,
                 store: CacheStore | None = None, verify: bool = True, truncate: str | None = None) -> None:
        if truncate not in (None, "start", "middle", "end"):
            raise ConfigError(f"--truncate takes start, middle or end, not {truncate!r}")
        self.loaded = loaded
        self.settings = settings
        self.store = store
        self.verify = verify
        self.truncate = truncate
        self.on_layer: Callable[[int, int], None] | None = None  # prefill progress, for a UI
        self.truncated_tokens = 0  # how many document tokens the last prompt_ids() cut
        self.last_prompt_tokens = 0  # length of the last prompt_ids()

    def prompt_ids(self, document: Document) -> torch.Tensor:
        """(n,) context ids. A document longer than the model's context is refused, or cut where
        `truncate` says (start / middle / end: the part removed); truncated_tokens tells how much."""
        tokenizer = self.loaded.tokenizer
        body = document_ids(tokenizer, document.text)
        overhead = context_ids(tokenizer, [0]).shape[0] - 1  # template tokens around the document
        limit = self.loaded.context_length
        room = limit - overhead - QUESTION_ALLOWANCE if limit else len(body)
        self.truncated_tokens = 0
        if len(body) > room:
            if self.truncate is None:
                raise DocumentError(
                    f"the document is {len(body)} tokens, and {self.loaded.name} holds {limit} tokens in all "
                    f"({room} for a document once the prompt template and {QUESTION_ALLOWANCE} tokens for the "
                    "question and answer are set aside). Pass --truncate start|middle|end to cut it, or use a "
                    "model with a longer context."
                )
            self.truncated_tokens = len(body) - room
            if self.truncate == "start":
                body = body[-room:]
            elif self.truncate == "end":
                body = body[:room]
            else:
                body = body[: room // 2] + body[len(body) - (room - room // 2):]
        ids = context_ids(tokenizer, body)
        self.last_prompt_tokens = ids.shape[0]
        return ids

    def _metadata(self, document: Document) -> dict:
        import transformers

        from . import __version__

        return {
            "model": self.loaded.identity,
            "stored": stored_settings(self.settings),
            "mode": "none" if self.settings is None else
                    ("query-aware" if self.settings.query_aware else "document-window"),
            "settings": None if self.settings is None else asdict(self.settings),
            "sources": [asdict(source) for source in document.sources],
            "producer": {"snapkv": __version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "created": time.time(),
        }

    def prepare(self, document: Document) -> PreparedDocument:
        """The document's cache: loaded from the store when it was made before, else prefilled (and saved)."""
        ids = self.prompt_ids(document)
        key = cache_key(self.loaded.identity, ids, stored_settings(self.settings)) if self.store else None
        note = ""
        if self.store is not None and (path := self.store.lookup(key)) is not None:
            try:
                prepared = self.load_file(path, check_sources=False)
            except CacheFileError as error:  # rebuilt and overwritten below
                note = f"the saved cache was unreadable and has been rebuilt ({error})"
            else:
                if torch.equal(prepared.cache.token_ids, ids):
                    prepared.document = document
                    return prepared
        tier = self.settings.stored_tier if self.settings is not None else None
        loaded = self.loaded
        check_prefill_fits(loaded.model, ids.shape[0], loaded.device, loaded.dtype, tier)
        started = time.perf_counter()
        try:
            with PeakMemory(loaded.device) as memory:
                cache = prefill(loaded.model, ids, tier, on_layer=self.on_layer)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            release_device_memory(loaded.device)
            raise OutOfMemoryError(
                f"ran out of memory prefilling {ids.shape[0]} tokens on {loaded.device} ({type(error).__name__}); "
                "nothing was saved. Use a shorter document (--truncate), a smaller budget with --no-query-aware, "
                "or another device."
            ) from error
        prepared = PreparedDocument(document, cache, prefill_seconds=time.perf_counter() - started, note=note,
                                    prefill_peak_bytes=memory.peak)
        if self.store is not None:
            try:
                self.save(prepared, self.store.path_for(key))
            except StorageError as error:  # the answers need only the cache in memory: go on without it
                prepared.note = f"{error} The next question on this document will prefill again."
        return prepared

    def save(self, prepared: PreparedDocument, path: Path) -> None:
        started = time.perf_counter()
        prepared.file_bytes = save_cache(path, prepared.cache, self._metadata(prepared.document))
        prepared.save_seconds = time.perf_counter() - started
        prepared.path = Path(path)

    def load_file(self, path: Path, check_sources: bool = True) -> PreparedDocument:
        """A saved cache, checked against the model in use and moved to its device and dtype.

        check_sources: note (in .note) when a recorded source file has changed since the cache was made.
        """
        started = time.perf_counter()
        cache, metadata = load_cache(path, identity=self.loaded.identity, device=self.loaded.layer_devices,
                                     dtype=self.loaded.dtype, verify=self.verify)
        sources = recorded_sources(path, metadata)
        stale = stale_sources(sources) if check_sources else []
        note = ("the cache is stale: " + "; ".join(stale) + ". Its answers reflect the old version; "
                "build a new cache from the document.") if stale else ""
        return PreparedDocument(Document("", sources), cache, path=Path(path), hit=True, note=note,
                                load_seconds=time.perf_counter() - started, file_bytes=Path(path).stat().st_size)

    def ask(self, prepared: PreparedDocument, question: str, *, answer_prefix: str = "",
            max_new_tokens: int = 256, sampling: Sampling = Sampling()) -> AnswerStream:
        return AnswerStream(self, prepared, question, answer_prefix, max_new_tokens, sampling)
