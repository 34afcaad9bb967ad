"""A chat request answered by a loaded model, as `snapkv ask` answers: the document's compressed cache taken from
memory or the store (made and saved when missing), the question as its query-aware window, the answer streamed.

A conversation's finished turns (the messages after the document) are appended to a working copy of the
document's cache (Session.with_turn), carried on from the last conversation's copy where the request continues it,
so that a follow-up costs its own tokens. ChatService.run is called on one worker thread (requests one at a time per model: snapkv.serving.openai_app queues
them) and reports through a callback, so that the web side never waits on torch. A request whose client has gone
(`cancel` set) stops between two tokens.
"""

import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from snapkv.base.errors import ConfigError, DocumentError, SnapKVError
from snapkv.compression.config import SnapKVConfig
from snapkv.engine.models import LoadedModel
from snapkv.io.documents import Document
from snapkv.serving.chat_request import ChatRequest, RequestError
from snapkv.session import PreparedDocument, Session
from snapkv.storage.store import CacheStore

# Documents whose prepared caches stay loaded for the next question (least recent dropped); the others are read back
# from the store (~0.2 s at 8k tokens on a CPU). One: a long document's cache can take gigabytes of a GPU's memory.
KEPT_IN_MEMORY = 1


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int   # of prompt_tokens, those whose cache was reused rather than prefilled (the document's)

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": 0}}


@dataclass(frozen=True)
class Finished:
    """How an answer ended: OpenAI's finish_reason, the usage, and snapkv's own figures."""

    finish_reason: str   # "stop" (end of turn or a stop sequence) or "length"
    usage: Usage
    details: dict


class StopScanner:
    """Text as it streams, held back only as far as a stop sequence could still be starting; cut before the first
    stop sequence found."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""
        self._keep = max((len(s) for s in stops), default=1) - 1
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be shown now."""
        if not self._stops:
            return piece
        text = self._held + piece
        found = [at for at in (text.find(s) for s in self._stops) if at >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[:min(found)]
        cut = max(len(text) - self._keep, 0)
        self._held = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class ChatService:
    """A loaded model answering chat requests, with the store the CLI uses (None: prefill every document)."""

    def __init__(self, loaded: LoadedModel, settings: SnapKVConfig | None, store: CacheStore | None,
                 truncate: str | None = None, cite: bool = False, kept_in_memory: int = KEPT_IN_MEMORY) -> None:
        """cite: list the passages each answer drew on where a request does not say (its snapkv.cite);
        kept_in_memory: documents whose prepared caches stay loaded for their next question."""
        self.loaded = loaded
        self._kept_in_memory = max(1, kept_in_memory)
        self._cite = cite
        self._settings = settings
        self._store = store
        self._truncate = truncate
        self._sessions: dict[str | None, Session] = {}
        self._prepared: OrderedDict[tuple, PreparedDocument] = OrderedDict()
        self._conversation: tuple[tuple, tuple, PreparedDocument] | None = None  # (document key, turns, prepared)
        self._lock = threading.Lock()  # run() is meant for one thread; this keeps a second caller out
        self._unsaved: list[PreparedDocument] = []  # prepared for a request, to be saved after its answer
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapkv-save")  # one save at a time

    @property
    def model_id(self) -> str:
        return self.loaded.name

    def _session(self, system: str | None) -> Session:
        if system not in self._sessions:
            self._sessions[system] = Session(self.loaded, self._settings, store=self._store, truncate=self._truncate,
                                             system=system)
        return self._sessions[system]

    def _prepare(self, session: Session, system: str | None, text: str) -> tuple[tuple, PreparedDocument, str]:
        """(its key, the document's prepared cache, where that came from: "memory", "store", "prefix" (a saved
        cache's prompt shared its first tokens) or "prefill")."""
        prompt = session.prompt(Document(text))
        key = (system, tuple(prompt.ids.tolist()))
        if key in self._prepared:
            self._prepared.move_to_end(key)
            return key, self._prepared[key], "memory"
        self.saved()  # the last request's caches are in the store, so that this prompt finds a prefix it shares with them
        # On an accelerator a long document's file takes seconds to write: saved once the answer is out, on a thread
        # of its own (save_pending), the CPU being free; on a CPU that thread would slow the next answer, so saved here.
        prepared = session.prepare(prompt, defer_save=self.loaded.device.type != "cpu")
        if prepared.pending_save is not None:
            self._unsaved.append(prepared)
        self._prepared[key] = prepared
        while len(self._prepared) > self._kept_in_memory:
            self._prepared.popitem(last=False)
        return key, prepared, "store" if prepared.hit else "prefix" if prepared.prefix_tokens else "prefill"

    def _with_turns(self, session: Session, key: tuple, document: PreparedDocument, reused: int,
                    turns: tuple[tuple[str, str], ...]) -> tuple[PreparedDocument, int]:
        """(the document's cache with the conversation's finished turns appended, the tokens of it reused): the last
        conversation's working copy is carried on where this one begins with its turns (so each turn is prefilled
        once), else the turns are appended to the document's. Never saved."""
        prepared, remaining = document, turns
        if self._conversation is not None:
            held_key, held_turns, held = self._conversation
            if held_key == key and turns[:len(held_turns)] == held_turns:
                prepared, reused, remaining = held, held.tokens, turns[len(held_turns):]
            elif held_key != key:  # another document: its working copy is not kept beside this one's cache
                self._conversation = None
        for question, answer in remaining:
            prepared = session.with_turn(prepared, question, answer)
        if turns:
            self._conversation = (key, turns, prepared)
        return prepared, reused

    def save_pending(self) -> None:
        """Save the caches made for the last request (on an accelerator, Session.prepare(defer_save=True)), once its
        answer is out, on a thread of their own: its client does not wait for the file, nor does a follow-up answered
        from memory; a request that looks in the store waits for it first (_prepare). What goes wrong is written to
        stderr: the next question on such a document prefills again."""
        with self._lock:
            unsaved, self._unsaved = self._unsaved, []
        for prepared in unsaved:
            self._saver.submit(self._save, prepared)

    @staticmethod
    def _save(prepared: PreparedDocument) -> None:
        before = len(prepared.notes)
        try:
            if prepared.pending_save is not None:
                prepared.pending_save()
        except Exception as error:  # a disk that fails oddly: the answers go on from memory
            prepared.notes.append(f"the cache was not saved: {type(error).__name__}: {error}")
        for note in prepared.notes[before:]:
            print(f"snapkv server: {note}", file=sys.stderr, flush=True)

    def saved(self, timeout: float | None = None) -> None:
        """Wait until every cache handed to the saving thread so far is saved."""
        self._saver.submit(lambda: None).result(timeout=timeout)

    def run(self, request: ChatRequest, cancel: threading.Event, emit: Callable[[str], None]) -> Finished | None:
        """Answer `request`, handing each piece of text to `emit`; None where `cancel` was set before it began.
        RequestError for a document or question the model cannot take."""
        with self._lock:
            if cancel.is_set():
                return None
            started = time.perf_counter()
            session = self._session(request.system)
            try:
                key, document, source = self._prepare(session, request.system, request.document)
                reused = document.tokens if source == "memory" else document.reused_tokens
                prepared, cached = self._with_turns(session, key, document, reused, request.turns)
                stream = session.ask(prepared, request.question, max_new_tokens=request.max_tokens,
                                     sampling=request.sampling)
            except (DocumentError, ConfigError) as error:  # too long for the model, ...
                raise RequestError(str(error), code="invalid_document") from error
            except SnapKVError as error:  # out of memory, a store it cannot write: not the request's fault
                raise RequestError(str(error), status=503, code="unavailable", kind="server_error") from error
            scanner = StopScanner(request.stop)
            pieces = iter(stream)
            try:
                for piece in pieces:
                    if text := scanner.feed(piece):
                        emit(text)
                    if scanner.stopped or cancel.is_set():
                        break
                else:
                    if text := scanner.flush():
                        emit(text)
            finally:
                pieces.close()  # the answer's result is set as far as it got
            result = stream.result
            cite = request.cite if request.cite is not None else self._cite
            citations, cite_failure = None, None
            if cite and not cancel.is_set():
                try:
                    citations = session.cite(prepared, stream)
                except (SnapKVError, RuntimeError) as error:  # out of memory, say: the answer stands, sent already
                    cite_failure = f"the passages could not be found: {error}"
            finish = "stop" if scanner.stopped else ("length" if result.finish_reason == "length" else "stop")
            usage = Usage(prepared.tokens + stream.question_tokens, result.new_tokens, cached)
            details = {"cache": "reused" if source in ("memory", "store") else "prefilled", "cache_source": source,
                       "document_tokens": document.tokens,
                       "conversation_turns": prepared.turns,
                       "mode": prepared.mode, "seconds": round(time.perf_counter() - started, 3),
                       "ttft_seconds": round(result.ttft_seconds, 3),
                       "decode_tokens_per_second": round(result.decode_tokens_per_second, 1),
                       "engine": result.engine.as_json()}
            if citations is not None:  # the passages of the document it drew on; lines count the document's text
                details.update(citations=[c.to_dict() for c in citations], cite_seconds=round(result.cite_seconds, 3))
            if cite_failure is not None:
                details["citations_error"] = cite_failure
            return Finished(finish, usage, details)
