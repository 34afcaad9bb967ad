"""The one front door: a model loaded once, documents turned into caches, questions into answers.

The CLI, bench, eval and the scripts under benchmarks/ all go through here, so the flow is written once:

    Session.prompt(document)    -> Prompt            context ids, cut to fit where asked
    Session.prepare(prompt)     -> PreparedDocument  a store hit, or prefill (the stored tier) + save
    Session.load_file(path)     -> PreparedDocument  a saved cache, answered as the file says
    Session.ask(prepared, q)    -> AnswerStream      text as it is generated; .result when it ends

A PreparedDocument holds the cache (which carries its own Tier) and the cut made per question;
nothing about a document is kept on the session.
"""

import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch

from snapkv.answering import cut_for_file
from snapkv.base.errors import CacheFileError, ConfigError, DocumentError, OutOfMemoryError, StorageError
from snapkv.citing import Citation, Passage, cite, document_passages
from snapkv.compression.config import Cut, Plan, SnapKVConfig, Tier, Truncation, mode_of
from snapkv.engine.engines import EngineUse, engine_setting
from snapkv.engine.generation import Sampling, answer, extended
from snapkv.engine.memory import (PeakMemory, check_prefill_fits, is_out_of_memory, release_device_memory,
                                  wait_for_device)
from snapkv.engine.models import LoadedModel
from snapkv.engine.tiers import build_tier, derive_tier, extend_tier
from snapkv.io.documents import Document, stale_sources
from snapkv.io.streaming import TextStream
from snapkv.storage.cache import CompressedCache
from snapkv.storage.cachefile import load_cache, per_question_of, recorded_sources, save_cache
from snapkv.storage.prefixes import CHUNK_TOKENS, shared_length
from snapkv.storage.store import CacheStore, cache_key, prefix_seed

# Room left after the document for the question and the answer when checking the context length.
QUESTION_ALLOWANCE = 128
# Rows a loaded cache keeps free after each head's positions, where a question's pass writes its keys and values
# instead of copying each layer whole (a longer question is appended by copying).
QUESTION_ROOM = 64
TRUNCATE_SIDES = ("start", "middle", "end")


@dataclass(frozen=True)
class Prompt:
    """A document's context ids, ready to prefill, and what was cut to make them fit."""

    document: Document
    ids: torch.Tensor              # (n,) context ids
    truncation: Truncation | None  # None when the whole document fits
    span: range | None = None      # where the document sits in the ids (None: all of them)

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def document_span(self) -> range:
        return self.span if self.span is not None else range(0, self.tokens)


@dataclass
class PreparedDocument:
    """A document's cache, ready for any number of questions, and how it was obtained.

    per_question: the cut each question makes, with the question as the window (query-aware); None
    answers against the cache as it is.
    """

    document: Document
    cache: CompressedCache
    per_question: Cut | None = None
    prefill_seconds: float = 0.0     # 0 when the cache came from a file
    path: Path | None = None         # the saved cache file, if any
    hit: bool = False                # True when the cache was loaded instead of prefilled
    load_seconds: float = 0.0
    load_split: dict = field(default_factory=dict)  # of load_seconds: read, digest, restore (cachefile.load_cache)
    save_seconds: float = 0.0
    file_bytes: int = 0
    notes: list[str] = field(default_factory=list)  # things the user should hear about (a rebuilt entry, staleness)
    prefill_peak_bytes: int = 0      # PeakMemory of the prefill (0 when loaded from a file)
    tier_seconds: float = 0.0        # of prefill_seconds, the part after the prefill: scoring, cut, rounding
    turns: int = 0                   # finished turns of a conversation appended to the cache (Session.with_turn)
    turn_tokens: int = 0             # the tokens of those turns (of `tokens`)
    document_stored_bytes: int | None = None  # the document's own cache as stored, once turns are appended
    pending_save: Callable[[], None] | None = None  # Session.prepare(defer_save=True): the save still to make
    prefix_tokens: int = 0           # where a saved cache's prompt shared this one's first tokens: how many were
                                     # reused from it rather than prefilled (Session.prepare)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose cache was taken from a saved one rather than prefilled: all on a hit, the shared
        prefix where one was reused, else none."""
        return self.cache.original_length - self.turn_tokens if self.hit else self.prefix_tokens

    @property
    def stored_kv_bytes(self) -> int:
        """The document's keys and values as stored (its file's bits), whatever turns were appended since."""
        return self.document_stored_bytes if self.document_stored_bytes is not None else self.cache.stored_kv_bytes

    @property
    def tokens(self) -> int:
        return self.cache.original_length

    @property
    def tier(self) -> Tier:
        return self.cache.tier

    @property
    def mode(self) -> str:
        return mode_of(self.tier.cut, self.per_question)

    @property
    def kept_per_question(self) -> int:
        """Prompt positions per KV head each answer is decoded against (the budget, or all held)."""
        if self.per_question is None:
            return self.cache.kept_tokens
        return min(self.cache.kept_tokens, self.per_question.budget)

    def decoded_kv_bytes(self, question_tokens: int) -> int:
        """KV bytes an answer decodes against: the per-question cut (prefix + the question) or all held."""
        cache = self.cache
        if self.per_question is None:
            return cache.kv_bytes
        kept = min(cache.kept_tokens, self.per_question.prefix_keep + question_tokens)
        return cache.kv_bytes * kept // max(cache.kept_tokens, 1)

    def answering_with(self, per_question: Cut | None) -> "PreparedDocument":
        """The same cache, answered with another per-question cut (a budget above what is held cuts nothing); a cut
        given as a share of the document is sized for this one (Cut.sized_for)."""
        if per_question is not None and per_question.keep is not None:
            per_question = per_question.sized_for(self.cache.original_length, self.cache.document)
        return replace(self, per_question=per_question)


@dataclass
class AnswerResult:
    question: str
    text: str
    new_tokens: int
    ttft_seconds: float
    decode_seconds: float
    peak_bytes: int = 0   # PeakMemory of the answer: question pass and decoding
    kv_bytes: int = 0     # the KV decoded against
    finish_reason: str = "stop"  # "stop" (an end-of-turn token), "length" (the token limit or the context's
                                 # end) or "interrupted" (Ctrl-C, or the reader went away)
    engine: EngineUse = field(default_factory=EngineUse)  # what ran the question pass and the steps
    citations: list[Citation] | None = None  # the passages it drew on (Session.cite), None where not asked for
    cite_seconds: float = 0.0                # the time finding them took

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        steps = self.new_tokens - 1
        return 1000 * self.decode_seconds / steps if steps > 0 else 0.0



class AnswerStream:
    """Iterate to get the answer's text as it is generated; `result` is set when it ends."""

    def __init__(self, loaded: LoadedModel, prepared: PreparedDocument, question: str, ids: torch.Tensor,
                 max_new_tokens: int, sampling: Sampling, stop_ids: frozenset[int], measure: bool,
                 engine: str = "auto", words: torch.Tensor | None = None) -> None:
        self._loaded = loaded
        self._prepared = prepared
        self.question = question
        self._ids = ids
        self._max_new_tokens = max_new_tokens
        self._sampling = sampling
        self._stop_ids = stop_ids
        self._measure = measure
        self._engine = engine
        self._words = words  # (prompt positions,) word ids, for a cut that keeps words whole
        self.result: AnswerResult | None = None
        self.answer_ids: list[int] = []  # the answer's token ids as they are generated (stop tokens left out)

    @property
    def question_ids(self) -> torch.Tensor:
        """(q,) the question as the model is given it (with the end of the turn and the answer's start)."""
        return self._ids

    @property
    def question_tokens(self) -> int:
        """Tokens of the question as the model is given it (with the end of the turn and the answer's start)."""
        return self._ids.shape[0]

    def __iter__(self) -> Iterator[str]:
        loaded, prepared = self._loaded, self._prepared
        tokenizer = loaded.tokenizer
        first_token_at = None
        text = TextStream(tokenizer)
        self.answer_ids = text.tokens
        pieces: list[str] = []
        finish = "interrupted"  # unless the loop ends by itself
        memory = PeakMemory(loaded.device, release=self._measure)
        used = EngineUse()
        started = time.perf_counter()
        try:
            with memory:
                started = time.perf_counter()  # after PeakMemory has handed memory back, when measuring
                for token in answer(loaded.model, prepared.cache, self._ids, per_question=prepared.per_question,
                                    max_new_tokens=self._max_new_tokens, stop_ids=self._stop_ids,
                                    sampling=self._sampling, engine=self._engine, used=used, words=self._words):
                    if first_token_at is None:
                        if self._measure:
                            wait_for_device(loaded.device)
                        first_token_at = time.perf_counter()
                    if piece := text.add(token):
                        pieces.append(piece)
                        yield piece
                if self._measure:
                    wait_for_device(loaded.device)
            finish = "length" if len(text.tokens) >= self._max_new_tokens else "stop"
            if piece := text.flush():
                pieces.append(piece)
                yield piece
        finally:  # an interrupted answer has its result too: what it said so far
            ended = time.perf_counter()
            first_token_at = first_token_at or ended
            self.result = AnswerResult(
                question=self.question, text="".join(pieces), new_tokens=len(text.tokens),
                ttft_seconds=first_token_at - started, decode_seconds=ended - first_token_at,
                peak_bytes=memory.peak,
                kv_bytes=prepared.decoded_kv_bytes(self._ids.shape[0]), finish_reason=finish, engine=used,
            )


class Session:
    """A loaded model, the compression settings asked for (None: keep the full cache, the baseline) and a store.

    store:    where caches are looked up and saved (None: neither; every document is prefilled).
    verify:   check each loaded cache's payload digest.
    truncate: how a document longer than the model's context is cut (start / middle / end: the part
              removed); None refuses it.
    allow_extrapolation: let prompts and answers run past the model's context (speed and memory
              measurements only: the answers are then not meaningful).
    engine:   which engine answers (snapkv.engine.engines: auto, native, torch, compiled, reference; None: SNAPKV_ENGINE,
              else auto); compiled's first answer over a new cache size pays the compile.
    """

    def __init__(self, loaded: LoadedModel, settings: SnapKVConfig | None,
                 store: CacheStore | None = None, verify: bool = True, truncate: str | None = None,
                 allow_extrapolation: bool = False, engine: str | None = None, system: str | None = None) -> None:
        """system: the system message documents are prompted with (None: snapkv.engine.prompting.DEFAULT_SYSTEM; "": the
        chat template's own); it is part of the context ids, so of the cache key."""
        if truncate not in (None, *TRUNCATE_SIDES):
            raise ConfigError(f"--truncate takes start, middle or end, not {truncate!r}")
        self.loaded = loaded
        self.prompter = loaded.prompter_for(system)
        self.settings = settings
        self.plan = Plan.of(settings)  # resolved once: what is stored, in which bits, and each question's cut
        self.store = store
        self.verify = verify
        self.truncate = truncate
        self.context_limit = 0 if allow_extrapolation else loaded.context_length  # 0: no limit
        self.engine = engine_setting(engine)
        # the last document's passages for citations: (its ids, its sources, the passages)
        self._passages: tuple[torch.Tensor, list, list[Passage]] | None = None

    # ------------------------------------------------------------------------------------ documents in

    def prompt(self, document: Document, max_tokens: int | None = None) -> Prompt:
        """The document's context ids. A document longer than the model's context (or than `max_tokens`
        context ids in all, for measurements) is refused, or cut where `truncate` says."""
        prompter = self.prompter
        body = prompter.document_ids(document.text)
        limit = self.context_limit
        room = limit - prompter.overhead - QUESTION_ALLOWANCE if limit else len(body)
        truncate = self.truncate
        if max_tokens is not None and max_tokens - prompter.overhead < room:
            room, truncate = max(max_tokens - prompter.overhead, 1), truncate or "end"
        truncation = None
        if len(body) > room:
            if truncate is None:
                raise DocumentError(
                    f"the document is {len(body)} tokens, and {self.loaded.name} holds {limit} tokens in all "
                    f"({room} for a document once the prompt template and {QUESTION_ALLOWANCE} tokens for the "
                    "question and answer are set aside). Pass --truncate start|middle|end to cut it, or use a "
                    "model with a longer context."
                )
            truncation = Truncation(truncate, len(body) - room)
            if truncate == "start":
                body = body[-room:]
            elif truncate == "end":
                body = body[:room]
            else:
                body = body[: room // 2] + body[len(body) - (room - room // 2):]
        ids = prompter.context_ids(body)
        return Prompt(document, ids, truncation, prompter.document_span(len(ids)))

    def prepare(self, source: Document | Prompt, *, on_layer: Callable[[int, int], None] | None = None,
                on_step: Callable[[int, int], None] | None = None, measure: bool = False,
                defer_save: bool = False) -> PreparedDocument:
        """The document's cache: loaded from the store when it was made before, else made from the saved cache that
        shares the longest prefix with it, or prefilled; then saved.

        on_layer: prefill progress, called with (layers done, layers in all).
        on_step:  progress of the stored tier's scoring passes after the prefill, (passes done, in all).
        measure:  for benchmarks: hand freed memory back to the OS before the prefill and wait for the
                  device, so that its time and peak memory are the prefill's own.
        defer_save: leave the saving to `prepared.pending_save()`, called once the answer is out (a server's).
        A cache made from a saved prefix and fewer than CHUNK_TOKENS more tokens is not saved: made again from that
        prefix in a fraction of a second, it would be a whole file more for a few tokens.
        """
        prompt = source if isinstance(source, Prompt) else self.prompt(source)
        plan = self.plan
        key = cache_key(self.loaded.identity, prompt.ids, plan.stored, plan.bits) if self.store else None
        seed = prefix_seed(self.loaded.identity, plan.stored, plan.bits)
        notes, unreadable = [], False
        try:
            path = self.store.lookup(key) if self.store is not None else None
        except StorageError as error:  # a shared store out of reach: made here, as if it were not there
            notes.append(str(error))
            path = None
        if path is not None:
            try:
                prepared = self._load(path, check_sources=False)
            except CacheFileError as error:  # rebuilt and overwritten below
                notes.append(f"the saved cache was unreadable and has been rebuilt ({error})")
                unreadable = True
            else:
                if torch.equal(prepared.cache.token_ids, prompt.ids):
                    return replace(prepared, document=prompt.document, per_question=plan.per_question)
        prepared = (self._from_longest_prefix(prompt, seed, notes, measure) if path is None else None) \
            or self._prefill(prompt, plan, on_layer, on_step, measure)
        prepared.notes = notes
        if self.store is not None and not (prepared.prefix_tokens and
                                           prepared.tokens - prepared.prefix_tokens < CHUNK_TOKENS):
            store_it = partial(self._store, prepared, key, seed, prompt.ids, unreadable)
            if defer_save:
                prepared.pending_save = store_it
            else:
                store_it()
        return prepared

    def _store(self, prepared: PreparedDocument, key: str, seed: str, ids: torch.Tensor, unreadable: bool) -> None:
        """Save a prepared cache in the store, share it where the store is shared, and index its prompt's prefixes;
        what fails is added to its notes (the answers need only the cache in memory)."""
        prepared.pending_save = None
        try:
            self.save(prepared, self.store.path_for(key))
        except StorageError as error:
            prepared.notes.append(f"{error} The next question on this document will prefill again.")
            return
        try:  # a shared store: the other machines' next question on it is a hit (an unreadable one replaced),
            self.store.publish(key, replace=unreadable)  # and a prompt that begins as this one finds it
            if self.plan.stored is None:
                self.store.index_prefixes(seed, ids, key)
        except StorageError as error:
            prepared.notes.append(str(error))

    def _from_longest_prefix(self, prompt: Prompt, seed: str, notes: list[str],
                             measure: bool) -> PreparedDocument | None:
        """The prompt's cache made from the saved one that shares the longest prefix with it (at least a chunk,
        snapkv.storage.prefixes): that prefix reused, only the rest run through the model. None where no saved cache
        shares one, or the session stores a cut tier (whose prefix is not the prefix's cache)."""
        plan, loaded = self.plan, self.loaded
        if self.store is None or plan.stored is not None:
            return None
        try:
            found = self.store.longest_prefix(seed, prompt.ids)
            saved = self._load(found[0], check_sources=False) if found is not None else None
        except StorageError as error:  # a shared store out of reach: prefilled as if nothing were there
            notes.append(str(error))
            return None
        except CacheFileError:  # a damaged cache: prefilled; its index entries are overwritten by the next save
            return None
        if saved is None or not saved.cache.holds_every_position:
            return None
        shared = shared_length(saved.cache.token_ids, prompt.ids)
        if shared < CHUNK_TOKENS:
            return None
        try:
            with PeakMemory(loaded.device, release=measure) as memory:
                started = time.perf_counter()
                cache = extend_tier(loaded.model, self.prompter, saved.cache, prompt.ids, shared,
                                    prompt.document_span, plan, Tier(truncation=prompt.truncation))
                wait_for_device(loaded.device)
                seconds = time.perf_counter() - started
        except Exception as error:  # out of memory with the saved cache beside: a prefill says what it needs
            if not is_out_of_memory(error):
                raise
            release_device_memory(loaded.device)
            return None
        return PreparedDocument(prompt.document, cache, plan.per_question, prefill_seconds=seconds,
                                prefill_peak_bytes=memory.peak, prefix_tokens=shared,
                                load_seconds=saved.load_seconds)

    def _prefill(self, prompt: Prompt, plan: Plan, on_layer: Callable[[int, int], None] | None,
                 on_step: Callable[[int, int], None] | None, measure: bool) -> PreparedDocument:
        loaded, ids = self.loaded, prompt.ids
        sized = plan.sized_for(prompt.tokens, prompt.document_span)
        check_prefill_fits(loaded.model, ids.shape[0], loaded.device, loaded.dtype, sized.during_prefill)
        try:
            with PeakMemory(loaded.device, release=measure) as memory:
                wait_for_device(loaded.device)
                started = time.perf_counter()
                timings: dict = {}
                cache = build_tier(loaded.model, self.prompter, ids, prompt.document_span, plan,
                                   Tier(truncation=prompt.truncation), on_layer=on_layer, on_step=on_step,
                                   timings=timings, prefill_dtype=loaded.prefill_dtype, question_room=QUESTION_ROOM)
                wait_for_device(loaded.device)
                seconds = time.perf_counter() - started
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            release_device_memory(loaded.device)
            raise OutOfMemoryError(
                f"ran out of memory prefilling {ids.shape[0]} tokens on {loaded.device} ({type(error).__name__}); "
                "nothing was saved. Use a shorter document (--truncate), a smaller budget with --no-query-aware, "
                "or another device."
            ) from error
        return PreparedDocument(prompt.document, cache, plan.per_question, prefill_seconds=seconds,
                                prefill_peak_bytes=memory.peak, tier_seconds=timings["tier_seconds"])

    def derive(self, whole: PreparedDocument, *, scores_memo: dict | None = None,
               on_step: Callable[[int, int], None] | None = None, measure: bool = False) -> PreparedDocument:
        """This session's stored tier made from a whole-prompt 16-bit cache already at hand, without a new
        prefill (a tier cut during the prefill, SnapKV's document window, needs one: ConfigError).

        scores_memo: a dict kept with `whole` so that several tiers of one cache score it once.
        """
        plan = self.plan
        if plan.during_prefill is not None:
            raise ConfigError(f"a {plan.stored.method.name} tier is cut during the prefill; prepare the document "
                              "instead")
        cache = whole.cache
        with PeakMemory(self.loaded.device, release=measure) as memory:
            started = time.perf_counter()
            sized = plan.sized_for(cache.original_length, cache.document)
            derived = derive_tier(self.loaded.model, self.prompter, cache, sized.after_prefill, plan.bits, on_step,
                                  scores_memo, QUESTION_ROOM)
            wait_for_device(self.loaded.device)
            seconds = time.perf_counter() - started
        return PreparedDocument(whole.document, derived, plan.per_question, prefill_seconds=seconds,
                                prefill_peak_bytes=memory.peak, tier_seconds=seconds)

    # ------------------------------------------------------------------------------------ files

    def save(self, prepared: PreparedDocument, path: Path) -> None:
        """Write the prepared cache to `path`; the file describes the cache and the cut it is answered with."""
        started = time.perf_counter()
        prepared.file_bytes = save_cache(path, prepared.cache, model=self.loaded.identity,
                                         per_question=prepared.per_question, sources=prepared.document.sources,
                                         system=self.prompter.system)
        prepared.save_seconds = time.perf_counter() - started
        prepared.path = Path(path)

    def load_file(self, path: Path, *, explicit: frozenset[str] = frozenset(),
                  check_sources: bool = True) -> PreparedDocument:
        """A saved cache, checked against the model in use and moved to its device and dtype.

        It is answered as the file says, unless `explicit` names settings (SnapKVConfig field names, or
        "no_compress") that the session's settings ask for instead: applied where meaningful (a smaller
        per-question budget), refused with what the file holds where not (snapkv.answering).
        check_sources: add a note when a recorded source file has changed since the cache was made.
        """
        prepared = self._load(path, check_sources=check_sources)
        per_question, notes = cut_for_file(path, prepared.tier, prepared.cache.kept_tokens,
                                           prepared.per_question, self.settings, explicit)
        prepared.notes.extend(notes)
        return prepared.answering_with(per_question)

    def _load(self, path: Path, check_sources: bool) -> PreparedDocument:
        started = time.perf_counter()
        split: dict = {}
        cache, metadata = load_cache(path, identity=self.loaded.identity, device=self.loaded.layer_devices,
                                     dtype=self.loaded.dtype, verify=self.verify, split=split,
                                     question_room=QUESTION_ROOM)
        vocabulary = self.loaded.model.get_input_embeddings().num_embeddings
        if int(cache.token_ids.max()) >= vocabulary:  # the ids are fed to the model when a tier is cut from the file
            raise CacheFileError(f"{path}: damaged cache (prompt ids beyond the model's {vocabulary} tokens)")
        sources = recorded_sources(path, metadata)
        stale = stale_sources(sources) if check_sources else []
        notes = [("the cache is stale: " + "; ".join(stale) + ". Its answers reflect the old version; "
                  "build a new cache from the document.")] if stale else []
        return PreparedDocument(Document("", sources), cache, per_question_of(path, metadata), path=Path(path),
                                hit=True, notes=notes, load_seconds=time.perf_counter() - started,
                                load_split=split, file_bytes=Path(path).stat().st_size)

    # ------------------------------------------------------------------------------------ answers out

    def with_turn(self, prepared: PreparedDocument, question: str, answer: str) -> PreparedDocument:
        """`prepared` with a finished turn of a conversation (a question and the answer given) appended to a working
        copy of its cache, so that the next question sees it and costs its own tokens, not the document's
        (snapkv.engine.generation.extended); the saved file and `prepared` are unchanged. DocumentError where the
        conversation would no longer leave room for a question."""
        ids = self.prompter.turn_ids(question, answer, follow_up=prepared.turns > 0)
        if self.context_limit and prepared.tokens + ids.shape[0] + QUESTION_ALLOWANCE > self.context_limit:
            raise DocumentError(f"the conversation has grown to {prepared.tokens + ids.shape[0]} tokens of the "
                                f"{self.loaded.context_length} {self.loaded.name} holds; start a new one (/clear, or "
                                "ask without --continue)")
        return replace(prepared, cache=extended(self.loaded.model, prepared.cache, ids), turns=prepared.turns + 1,
                       turn_tokens=prepared.turn_tokens + ids.shape[0], document_stored_bytes=prepared.stored_kv_bytes)

    def cite(self, prepared: PreparedDocument, stream: AnswerStream) -> list[Citation]:
        """The passages of the document `stream`'s finished answer drew on, best first (snapkv.citing), also set as
        its result's citations; [] for an empty answer."""
        started = time.perf_counter()
        cache = prepared.cache
        document_ids = cache.token_ids[cache.document.start:cache.document.stop]
        sources = list(prepared.document.sources)
        known = self._passages
        if known is None or known[1] != sources or not torch.equal(known[0], document_ids):
            passages = document_passages(self.loaded.tokenizer, cache.token_ids, cache.document, sources,
                                         cache.tier.truncation)
            self._passages = known = (document_ids, sources, passages)  # the next question's too
        citations = cite(self.loaded.model, cache, stream.question_ids, torch.tensor(stream.answer_ids, dtype=torch.long),
                         known[2])
        if stream.result is not None:
            stream.result.citations = citations
            stream.result.cite_seconds = time.perf_counter() - started
        return citations

    def ask(self, prepared: PreparedDocument, question: str, *, answer_prefix: str = "",
            max_new_tokens: int = 256, sampling: Sampling = Sampling(), stop_at_end: bool = True,
            measure: bool = False) -> AnswerStream:
        """An answer to `question`, streamed as text; never decodes past the model's context.

        stop_at_end: end at the model's end-of-turn tokens (False: always `max_new_tokens`, for timing).
        measure:     for benchmarks: memory handed back first, device waited for at the first and last token.
        """
        loaded = self.loaded
        ids = self.prompter.question_ids(question, answer_prefix, follow_up=prepared.turns > 0)
        if self.context_limit:  # never decode past the positions the model was trained for
            room = self.context_limit - prepared.tokens - ids.shape[0]
            if room < 1:
                raise DocumentError(
                    f"the question ({ids.shape[0]} tokens) does not fit after the {prepared.tokens}-token document "
                    f"in {loaded.name}'s {loaded.context_length} positions; ask a shorter question"
                )
            max_new_tokens = min(max_new_tokens, room)
        stop_ids = loaded.stop_ids if stop_at_end else frozenset()
        per_question = prepared.per_question
        words = (self.prompter.word_ids(prepared.cache.token_ids, per_question.numbers_with_neighbours)
                 if per_question is not None and per_question.whole_words else None)
        return AnswerStream(loaded, prepared, question, ids, max_new_tokens, sampling, stop_ids, measure,
                            self.engine, words)
