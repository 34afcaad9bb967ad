"""Turn a document and questions into token ids, split so the document part is prefilled once.

The model's chat template is rendered once with placeholders, then cut around them:

    [template head + instruction + document] | [question + template tail (assistant turn start)]
              context ids                                   question ids

Template text is tokenized with its control tokens; document and question text are tokenized
with special tokens split, so a document containing "<|im_start|>" stays plain text.
"""

from dataclasses import dataclass

import torch

from .errors import DocumentError

_DOCUMENT_SLOT = "\x00SNAPKV_DOCUMENT\x00"
_QUESTION_SLOT = "\x00SNAPKV_QUESTION\x00"
INSTRUCTION = "Answer the question using the document below.\n\n<document>\n"
USER_MESSAGE = f"{INSTRUCTION}{_DOCUMENT_SLOT}\n</document>\n\nQuestion:{_QUESTION_SLOT}"
PLAIN_TEMPLATE = f"{USER_MESSAGE}\nAnswer:"


@dataclass(frozen=True)
class PromptTemplate:
    """The rendered chat template around the document and question slots."""

    head: str    # before the document
    middle: str  # between the document and the question
    tail: str    # after the question: end of the user turn, start of the assistant turn

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "PromptTemplate":
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": USER_MESSAGE}], tokenize=False, add_generation_prompt=True
            )
        else:
            rendered = PLAIN_TEMPLATE
        head, rest = rendered.split(_DOCUMENT_SLOT)
        middle, tail = rest.split(_QUESTION_SLOT)
        return cls(head, middle, tail)


def _template_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def _plain_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids if text else []


def document_ids(tokenizer, document: str) -> list[int]:
    """The document's own tokens, as plain text."""
    return _plain_ids(tokenizer, document)


def context_ids(tokenizer, document: str | list[int]) -> torch.Tensor:
    """(n,) ids of everything before the question: template head, instruction, document, middle."""
    if not isinstance(document, list):
        document = document_ids(tokenizer, document)
    if not document:
        raise DocumentError("the document has no text to ask about")
    template = PromptTemplate.for_tokenizer(tokenizer)
    ids = _template_ids(tokenizer, template.head) + document + _template_ids(tokenizer, template.middle)
    return torch.tensor(ids, dtype=torch.long)


def question_ids(tokenizer, question: str, answer_prefix: str = "") -> torch.Tensor:
    """(q,) ids of the question, the end of the user turn and the start of the answer.

    answer_prefix starts the assistant's reply (e.g. "The special magic number is"), which small
    models follow well.
    """
    if not question.strip():
        raise DocumentError("the question is empty")
    template = PromptTemplate.for_tokenizer(tokenizer)
    ids = _plain_ids(tokenizer, " " + question.strip()) + _template_ids(tokenizer, template.tail)
    ids += _plain_ids(tokenizer, answer_prefix)
    return torch.tensor(ids, dtype=torch.long)
