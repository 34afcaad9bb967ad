"""Turn a document and questions into token ids, split so the document part is prefilled once.

The model's chat template is rendered once with placeholders, then cut around them:

    [template head + instruction + document] | [question + template tail (assistant turn start)]
              context ids                                   question ids

Template text is tokenized with its control tokens; document and question text are tokenized
with special tokens split, so a document containing "<|im_start|>" stays plain text.
"""

from dataclasses import dataclass
from functools import partial

import torch

from snapkv.base.errors import DocumentError
from snapkv.compression.config import DEFAULT_SYSTEM

_DOCUMENT_SLOT = "\x00SNAPKV_DOCUMENT\x00"
_QUESTION_SLOT = "\x00SNAPKV_QUESTION\x00"
_ANSWER_SLOT = "\x00SNAPKV_ANSWER\x00"
_NEXT_SLOT = "\x00SNAPKV_NEXT\x00"
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
    def for_tokenizer(cls, tokenizer, system: str = DEFAULT_SYSTEM) -> "PromptTemplate":
        """The template with `system` as its system message ("" for the template's own default)."""
        user = [{"role": "user", "content": USER_MESSAGE}]
        if getattr(tokenizer, "chat_template", None):
            render = partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
            try:
                rendered = render(([{"role": "system", "content": system}] if system else []) + user)
            except Exception:  # a template without a system role: the message opens the user's turn instead
                rendered = render([{"role": "user", "content": f"{system}\n\n{USER_MESSAGE}"}])
        else:
            rendered = (f"{system}\n\n" if system else "") + PLAIN_TEMPLATE
        head, rest = rendered.split(_DOCUMENT_SLOT)
        middle, tail = rest.split(_QUESTION_SLOT)
        return cls(head, middle, tail)


@dataclass(frozen=True)
class TurnTemplate:
    """The rendered chat template around a conversation's later turns: after an answer, the end of the assistant's
    turn and the start of the user's next one; after a follow-up question, the end of that turn and the start of
    the assistant's."""

    after_answer: str
    tail: str

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "TurnTemplate":
        """Cut from the template rendered for [user, assistant, user], without a system message (templates that put
        it on the last user turn would repeat it in every turn); plain text where the template does not render
        such a conversation (or has no template)."""
        plain = cls("\n\nQuestion:", "\nAnswer:")
        if not getattr(tokenizer, "chat_template", None):
            return plain
        messages = [{"role": "user", "content": USER_MESSAGE}, {"role": "assistant", "content": _ANSWER_SLOT},
                    {"role": "user", "content": _NEXT_SLOT}]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            after_answer, tail = rendered.split(_ANSWER_SLOT, 1)[1].split(_NEXT_SLOT, 1)
        except Exception:  # an assistant turn rewritten, a slot dropped: plain text
            return plain
        return cls(after_answer, tail)


def _template_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def _plain_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids if text else []


# How a token's text marks a leading space or line break: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece
WORD_START_MARKS = frozenset("Ġ▁Ċĉ")


class Prompter:
    """One tokenizer's chat template with one system message, rendered and tokenized once, turning documents and
    questions into ids."""

    def __init__(self, tokenizer, system: str = DEFAULT_SYSTEM) -> None:
        template = PromptTemplate.for_tokenizer(tokenizer, system)
        self.tokenizer = tokenizer
        self.system = system
        # which tokens start a word and which hold a digit (word_ids), made on first use
        self._marks: tuple[torch.Tensor, torch.Tensor] | None = None
        self.head_ids = _template_ids(tokenizer, template.head)
        self.middle_ids = _template_ids(tokenizer, template.middle)
        self.tail_ids = _template_ids(tokenizer, template.tail)
        turn = TurnTemplate.for_tokenizer(tokenizer)
        self.after_answer_ids = _template_ids(tokenizer, turn.after_answer)
        self.follow_up_tail_ids = _template_ids(tokenizer, turn.tail)

    def word_ids(self, token_ids: torch.Tensor, numbers_with_neighbours: bool = False) -> torch.Tensor:
        """(n,) token ids -> (n,) int64 word ids, ascending: a token that starts with white space (or is a special
        token) starts a new word, any other continues the one before, so that "2,150", "IRCS-2021-04817" or "1.84"
        is one word however many tokens it takes (snapkv.compression.scoring.word_maxima).

        numbers_with_neighbours: a word with a digit in it is one with the words either side of it, so that
        "on 14 March 2025 at" or "was 2,150 feet" ranks as one."""
        token_ids = token_ids.cpu()
        starts = self._word_starts()[token_ids]  # (n,) bool
        if not starts.numel():
            return starts.long()
        starts[0] = True
        words = starts.long().cumsum(0)  # (n,) from 1
        if numbers_with_neighbours:
            digits = torch.zeros(int(words[-1]) + 1, dtype=torch.long)  # (words + 1,): digit tokens in word w
            numeric = digits.index_add_(0, words, self._digits()[token_ids].long()) > 0
            # a word joins the one before where either of them holds a digit
            joined = starts & (numeric[words] | numeric[words - 1])
            joined[0] = False
            words = (starts & ~joined).long().cumsum(0)
        return words

    def _word_starts(self) -> torch.Tensor:
        """(vocabulary,) bool: which tokens start a word (_token_marks)."""
        return self._token_marks()[0]

    def _digits(self) -> torch.Tensor:
        """(vocabulary,) bool: which tokens hold a digit (_token_marks)."""
        return self._token_marks()[1]

    def _token_marks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(vocabulary,) bool twice, from the tokens' own text in one pass over the vocabulary, computed once: which
        tokens start a word (byte-level BPE's Ġ/Ċ, or SentencePiece's ▁, for a leading space or line break; a special
        token), and which hold a digit."""
        if self._marks is None:
            tokenizer = self.tokenizer
            size = max(len(tokenizer), getattr(tokenizer, "vocab_size", 0) or 0)
            pieces = [p if isinstance(p, str) else "" for p in tokenizer.convert_ids_to_tokens(list(range(size)))]
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            starts = torch.tensor([index in special or not piece or piece[0] in WORD_START_MARKS
                                   or piece[0].isspace() for index, piece in enumerate(pieces)], dtype=torch.bool)
            digits = torch.tensor([any(c.isdigit() for c in piece) for piece in pieces], dtype=torch.bool)
            self._marks = (starts, digits)
        return self._marks

    @property
    def overhead(self) -> int:
        """Template tokens around the document in the context ids."""
        return len(self.head_ids) + len(self.middle_ids)

    def document_ids(self, document: str) -> list[int]:
        """The document's own tokens, as plain text."""
        return _plain_ids(self.tokenizer, document)

    def plain_ids(self, text: str) -> list[int]:
        """Any text's tokens, control tokens in it kept as text."""
        return _plain_ids(self.tokenizer, text)

    def document_span(self, context_length: int) -> range:
        """Where the document sits in context ids of this length: between the template's head and middle."""
        return range(len(self.head_ids), context_length - len(self.middle_ids))

    def context_ids(self, document: str | list[int]) -> torch.Tensor:
        """(n,) ids of everything before the question: template head, instruction, document, middle."""
        if not isinstance(document, list):
            document = self.document_ids(document)
        if not document:
            raise DocumentError("the document has no text to ask about")
        return torch.tensor(self.head_ids + document + self.middle_ids, dtype=torch.long)

    def question_ids(self, question: str, answer_prefix: str = "", follow_up: bool = False) -> torch.Tensor:
        """(q,) ids of the question, the end of the user turn and the start of the answer.

        answer_prefix starts the assistant's reply (e.g. "The special magic number is"), which small
        models follow well. follow_up: a question after earlier turns of a conversation (turn_ids), a user
        message of its own rather than the question slot after the document.
        """
        if not question.strip():
            raise DocumentError("the question is empty")
        if follow_up:
            ids = _plain_ids(self.tokenizer, question.strip()) + self.follow_up_tail_ids
        else:
            ids = _plain_ids(self.tokenizer, " " + question.strip()) + self.tail_ids
        ids += _plain_ids(self.tokenizer, answer_prefix)
        return torch.tensor(ids, dtype=torch.long)

    def turn_ids(self, question: str, answer: str, follow_up: bool) -> torch.Tensor:
        """(t,) ids of one finished turn of a conversation, as a later question sees it: the question (as
        question_ids), the answer given, the end of the assistant's turn and the start of the user's next."""
        answered = _plain_ids(self.tokenizer, answer) + self.after_answer_ids
        return torch.cat([self.question_ids(question, follow_up=follow_up), torch.tensor(answered, dtype=torch.long)])


# One-off conveniences (each renders the template again; a Session keeps one Prompter).

def document_ids(tokenizer, document: str) -> list[int]:
    return _plain_ids(tokenizer, document)


def context_ids(tokenizer, document: str | list[int]) -> torch.Tensor:
    return Prompter(tokenizer).context_ids(document)


def question_ids(tokenizer, question: str, answer_prefix: str = "") -> torch.Tensor:
    return Prompter(tokenizer).question_ids(question, answer_prefix)
