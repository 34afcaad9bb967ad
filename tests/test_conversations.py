"""Conversations: a finished turn appended to a working copy of the document's cache (Session.with_turn), so that
the next question sees it and pays for its own tokens only."""

from dataclasses import replace

import pytest
import torch

from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.session import Prompt, Session

DOCUMENT = Document(" ".join(f"Fact {i}: the value of item {i} is {i * 7}, kept in room {100 + i}." for i in range(30)))
FIRST, SECOND = "What is the value of item 3?", "And which room holds item 5?"


@pytest.mark.parametrize("settings", [None, SnapKVConfig(budget=64, window=8, store_bits=16)],
                         ids=["full cache", "query-aware cut of 64"])
def test_a_second_turn_answers_as_one_prompt_holding_the_whole_conversation(tiny_loaded, settings):
    session = Session(tiny_loaded, settings)
    prepared = session.prepare(DOCUMENT)
    first = "".join(session.ask(prepared, FIRST, max_new_tokens=10))
    turned = session.with_turn(prepared, FIRST, first)
    second = "".join(session.ask(turned, SECOND, max_new_tokens=10))

    # the same conversation as one prompt: the context and the turn prefilled together, the same settings
    context = session.prompt(DOCUMENT)
    whole = Prompt(DOCUMENT, torch.cat([context.ids, session.prompter.turn_ids(FIRST, first, follow_up=False)]),
                   None, context.document_span)
    single = replace(session.prepare(whole), turns=1)
    assert turned.cache.original_length == single.cache.original_length > context.ids.shape[0]
    for held, expected in zip(turned.cache.positions, single.cache.positions):
        assert torch.equal(held, expected)
    torch.testing.assert_close(turned.cache.keys[-1], single.cache.keys[-1], rtol=1e-4, atol=1e-4)
    assert second == "".join(session.ask(single, SECOND, max_new_tokens=10))
    # the document's cache itself is unchanged: a new conversation starts from it
    assert prepared.turns == 0 and prepared.cache.original_length == context.ids.shape[0]
    assert "".join(session.ask(prepared, FIRST, max_new_tokens=10)) == first


def test_a_follow_up_is_its_own_user_message_in_the_chat_template(embedded):
    prompter = Session(embedded, None).prompter
    text = embedded.tokenizer.decode(prompter.turn_ids(FIRST, "Seven.", follow_up=False))
    assert text.startswith(" " + FIRST) and text.endswith("Seven.<|im_end|>\n<|im_start|>user\n")
    follow = embedded.tokenizer.decode(prompter.question_ids(SECOND, follow_up=True))
    assert follow == SECOND + "<|im_end|>\n<|im_start|>assistant\n"


def test_a_conversation_that_would_not_leave_room_for_a_question_is_refused(tiny_loaded):
    from snapkv.base.errors import DocumentError

    session = Session(tiny_loaded, None)
    prepared = session.prepare(DOCUMENT)
    with pytest.raises(DocumentError, match="the conversation has grown"):
        session.with_turn(prepared, FIRST, "word " * tiny_loaded.context_length)
