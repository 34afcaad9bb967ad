"""Documents of the sizes where off-by-one errors live: 0, 1, window, budget, and around the context length.

A tiny random Llama (1024 positions) with the embedded model's tokenizer; budget 64, window 8.
"""

import pytest

from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.base.errors import DocumentError
from snapkv.engine.prompting import context_ids, document_ids, question_ids
from snapkv.session import QUESTION_ALLOWANCE, Session

BUDGET, WINDOW = 64, 8
MODES = {"query-aware": True, "document-window": False}


def document_of(tokenizer, tokens: int) -> Document:
    """A document of exactly `tokens` tokens."""
    text = " ".join(["river"] * tokens)
    assert len(document_ids(tokenizer, text)) == tokens
    return Document(text)


def answer_tokens(session: Session, document: Document, max_new_tokens: int = 8) -> int:
    prepared = session.prepare(document)
    stream = session.ask(prepared, "What flows?", max_new_tokens=max_new_tokens)
    "".join(stream)
    if prepared.mode == "document-window":  # compressed at prefill to the budget, or left whole when shorter
        assert prepared.cache.kept_tokens == min(BUDGET, prepared.tokens)
    return stream.result.new_tokens


def session_for(tiny_loaded, mode: str, truncate: str | None = None) -> Session:
    settings = SnapKVConfig(budget=BUDGET, window=WINDOW, query_aware=MODES[mode])
    return Session(tiny_loaded, settings, truncate=truncate)


def room(tiny_loaded) -> int:
    """The longest document the context holds with the question allowance set aside."""
    overhead = context_ids(tiny_loaded.tokenizer, [0]).shape[0] - 1
    return tiny_loaded.context_length - overhead - QUESTION_ALLOWANCE


@pytest.mark.parametrize("mode", sorted(MODES))
def test_empty_document_is_refused(tiny_loaded, mode):
    with pytest.raises(DocumentError, match="no text"):
        session_for(tiny_loaded, mode).prepare(Document(""))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("tokens", [1, WINDOW, BUDGET, "room"])
def test_small_and_full_documents_are_answered(tiny_loaded, mode, tokens):
    tokens = room(tiny_loaded) if tokens == "room" else tokens
    session = session_for(tiny_loaded, mode)
    assert answer_tokens(session, document_of(tiny_loaded.tokenizer, tokens)) >= 1


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_documents_around_the_context_are_refused_or_cut(tiny_loaded, offset):
    context = tiny_loaded.context_length
    document = document_of(tiny_loaded.tokenizer, context + offset)
    with pytest.raises(DocumentError, match=f"the document is {context + offset} tokens.*--truncate"):
        session_for(tiny_loaded, "query-aware").prepare(document)
    session = session_for(tiny_loaded, "query-aware", truncate="end")
    prepared = session.prepare(document)
    assert prepared.tier.truncation.tokens == context + offset - room(tiny_loaded)
    assert prepared.tokens == context - QUESTION_ALLOWANCE
    # a long answer stops at the last position the model holds
    stream = session.ask(prepared, "What flows?", max_new_tokens=10_000)
    "".join(stream)
    question = question_ids(tiny_loaded.tokenizer, "What flows?", "").shape[0]
    assert stream.result.new_tokens == context - prepared.tokens - question, "stopped before the context filled"


def test_room_plus_one_is_refused(tiny_loaded):
    document = document_of(tiny_loaded.tokenizer, room(tiny_loaded) + 1)
    with pytest.raises(DocumentError, match="Pass --truncate"):
        session_for(tiny_loaded, "document-window").prepare(document)
