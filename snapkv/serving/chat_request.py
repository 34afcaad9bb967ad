"""An OpenAI chat completion request, checked and turned into what snapkv answers: a document (everything before the
last user message), a question (that message), and how to decode.

The API's conventions (https://platform.openai.com/docs/api-reference/chat/create): `messages` in order, each with a
`role` and a `content` that is a string or a list of text parts. snapkv reads them as a document and a question:

    user / assistant messages     before the last user message: the document, their texts joined by blank lines;
                                  from the user message before the first assistant message on, where a message
                                  comes before that one and they alternate, the conversation's finished turns
    system / developer messages   the system message the document is prompted with (part of its cache key); the
                                  document itself where no other message comes before the question
    the last user message         the question, the query-aware window that cuts the document's cache; where it
                                  is the only message, its last paragraph (_split_one_message), the rest the document

snapkv's own options ride in a `snapkv` object: {"snapkv": {"cite": true}} lists the passages the answer drew on in
the response's `snapkv.citations` (extra_body with the openai client).

A parameter snapkv does not honour is refused with a 400 naming it, unless it is given its neutral value (n=1,
logprobs false, penalties 0, ...): a client that sends it set expects something snapkv would silently not do.
"""

import re
from dataclasses import dataclass, field

from snapkv.engine.generation import Sampling

MAX_MESSAGES = 1024
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_TOKENS_CAP = 32768       # the most tokens one answer may ask for (the model's context bounds it further)
DEFAULT_MAX_TOKENS = 512
SYSTEM_ROLES = ("system", "developer")
TEXT_ROLES = ("user", "assistant")

# Parameters read below; the others are refused unless they hold the neutral value listed here.
READ = frozenset({"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                  "temperature", "top_p", "seed", "stop", "snapkv"})
SNAPKV_OPTIONS = ("cite",)  # what the request's own "snapkv" object may hold
IGNORED = frozenset({"user", "metadata", "store", "safety_identifier", "prompt_cache_key", "service_tier"})
# Tools offered that the model may leave unused (tool_choice absent, "auto" or "none"): answered in text, as a model that
# calls none does (Open WebUI offers its built-in tools with every chat)
OPTIONAL_TOOLS = ("tools", "functions", "tool_choice", "function_call", "parallel_tool_calls")
NEUTRAL = {"n": (1, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
           "logprobs": (False, None), "top_logprobs": (0, None), "logit_bias": ({}, None), "tools": ([], None),
           "tool_choice": ("none", None), "functions": ([], None), "function_call": ("none", None),
           "parallel_tool_calls": (None, False, True), "response_format": ({"type": "text"}, None),
           "modalities": (["text"], None), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
           "reasoning_effort": (None,), "verbosity": (None,)}


class RequestError(ValueError):
    """A request the API refuses: the HTTP status, and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str = "invalid_request_error", kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """What a chat completion asks of snapkv."""

    model: str
    system: str | None                   # None: snapkv's default system message
    document: str                        # the context: every user and assistant text before the question
    question: str
    turns: tuple[tuple[str, str], ...] = ()  # the conversation's finished turns before the question: (question, answer)
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False          # stream_options.include_usage: a last chunk with the usage
    cite: bool | None = None             # snapkv.cite: list the passages the answer drew on (None: the server's choice)
    ignored: list[str] = field(default_factory=list)  # parameters accepted and not acted on


def _encodable(text: str, where: str) -> str:
    """The text, where it is UTF-8 (JSON lets a lone surrogate such as "\\ud800" through; no tokenizer takes one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(f"{where} holds {error.object[error.start:error.end]!a} at character {error.start}, which "
                           "is not text (a lone UTF-16 surrogate)", param=where, code="invalid_text") from None
    return text


def _text_of(content, index: int) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts joined."""
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return _encodable(content, where)
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}[{number}] is a {kind!r} part; snapkv reads text parts only",
                                   param=f"{where}[{number}]", code="unsupported_content")
            texts.append(part["text"])
        return _encodable("".join(texts), where)
    raise RequestError(f"{where} must be a string or a list of text parts", param=where)


def _number(body: dict, name: str, kind: type, low: float, high: float, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise RequestError(f"{name} must be {'a number' if kind is float else 'an integer'}, not {value!r}",
                           param=name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low:g} and {high:g}, not {value!r}", param=name)
    return kind(value)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings of "
                           f"at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(_encodable(stop, "stop") for stop in stops)


def _cite(body: dict) -> bool | None:
    """snapkv's own options ({"snapkv": {"cite": true}}, extra_body in the openai client): whether to cite."""
    options = body.get("snapkv")
    if options is None:
        return None
    if not isinstance(options, dict) or not set(options) <= set(SNAPKV_OPTIONS):
        raise RequestError(f"snapkv must be an object holding {', '.join(SNAPKV_OPTIONS)}", param="snapkv")
    cite = options.get("cite")
    if cite is not None and not isinstance(cite, bool):
        raise RequestError("snapkv.cite must be true or false", param="snapkv.cite")
    return cite


def _turns(conversation: list[tuple[str, str]]) -> tuple[tuple[str, str], ...] | None:
    """(question, answer) pairs of messages that alternate user, assistant, each question with text; None
    otherwise (a question left unanswered by an error, say)."""
    if len(conversation) % 2 or any(role != ("user", "assistant")[i % 2] for i, (role, _) in enumerate(conversation)):
        return None
    turns = tuple((conversation[i][1], conversation[i + 1][1]) for i in range(0, len(conversation), 2))
    return turns if all(question.strip() for question, _ in turns) else None


def _document_and_turns(texts: list[tuple[str, str]], systems: list[str]) -> tuple[str, tuple, list[str]]:
    """(the document, the finished turns, the system messages left as the system prompt) from the user and assistant
    texts before the question. The turns start at the user message before the first assistant message and alternate
    from there; what comes before it is the document. With no message at all before the question, or none before the
    first turn, the system messages are the document (`llm -s DOCUMENT QUESTION`, then `llm -c` sends the same system
    message and the turns: the same document, so the same cache). Where no message comes before the first turn and no
    system message either (the document inside the first question), or they do not alternate, everything before the
    question is the document, as without turns."""
    if not texts and systems:
        return "\n\n".join(systems), (), []
    roles = [role for role, _ in texts]
    first = roles.index("assistant") - 1 if "assistant" in roles else -1  # the first turn's question
    if first == 0 and systems and (turns := _turns(texts)) is not None:
        return "\n\n".join(systems), turns, []
    turns = _turns(texts[first:]) if first >= 1 else None
    if turns is None:
        return "\n\n".join(text for _, text in texts), (), systems
    return "\n\n".join(text for _, text in texts[:first]), turns, systems


# A line that closes an attached block: a code fence, or a closing tag (</context>, </document>, </source>, ...)
_CLOSING_LINE = re.compile(r"^[ \t]*(?:```|~~~|</[A-Za-z_][\w.:-]*>)[ \t]*$", re.MULTILINE)


def _last_block(text: str) -> tuple[str, str] | None:
    """(the stripped text up to and with the closing line of its last attached block, what follows it, stripped), or
    None where no line closes a block (a code fence, a closing tag)."""
    text = text.strip()
    closings = list(_CLOSING_LINE.finditer(text))
    if not closings:
        return None
    end = closings[-1].end()
    return text[:end].strip(), text[end:].strip()


def _ends_with_block(text: str) -> bool:
    """Whether the text ends with the closing line of an attached block."""
    block = _last_block(text)
    return block is not None and not block[1]


def _split_one_message(text: str) -> tuple[str, str] | None:
    """(document, question) of a message that holds both, the layout most scripts and chat front ends send.

    Where the message attaches its document as a block (a fenced code block, <context>...</context>) and one
    paragraph follows the block's last closing line, that paragraph is the question (LibreChat, Continue, Open WebUI);
    a message that ends with such a line is a document alone (None). Otherwise the question is the last paragraph
    (or, with no blank line, the last line), unless that does not read as a question and the first paragraph does
    ("Answer from this report:", "What was the revenue?"), which is then the question; None where the message is one
    paragraph of one line. The document's own trailing white space is not part of it, so that `$(cat f)` and
    `open(f).read()` are the same document."""
    text = text.strip()
    block = _last_block(text)
    if block is not None:
        if not block[1]:
            return None
        if "\n\n" not in block[1]:
            return block
    separator = "\n\n" if "\n\n" in text else "\n"
    parts = [part for part in text.split(separator) if part.strip()]
    if len(parts) < 2:
        return None
    first, last = parts[0].strip(), parts[-1].strip()
    if not last.endswith("?") and first.endswith(("?", ":")):
        return separator.join(parts[1:]).strip(), first
    return separator.join(parts[:-1]).strip(), last


def _layout(systems: list[str], texts: list[tuple[str, str]],
            question: str) -> tuple[str, str, tuple, list[str]] | None:
    """(document, question, finished turns, system messages left as the system prompt), where the document is the
    longest text the request carries and the other messages fit around it; None where they do not (then
    _document_and_turns reads the request).

    The longest text may be: the system messages (`llm -s DOCUMENT`, the turns after them); the question's own
    document (one message holding both, _split_one_message; Open WebUI puts the document before every question,
    earlier turns before it); or a user message before the question: the first turn's question holding the document
    (LibreChat, Continue: the document and the first question, then the answer and the follow-ups), or a message that
    is the document alone followed by the assistant's acknowledgement, which is dropped (aider's files: "Ok, ...")."""
    system_text = "\n\n".join(systems)
    in_question = _split_one_message(question)
    longest = max(([("question", len(in_question[0]))] if in_question else [])
                  + [("system", len(system_text))] * bool(systems)
                  + [(index, len(text)) for index, (role, text) in enumerate(texts) if role == "user"],
                  key=lambda item: item[1], default=None)
    if longest is None:
        return None
    where = longest[0]
    if where == "question":
        turns = _turns(texts)
        return (in_question[0], in_question[1], turns, systems) if turns is not None else None
    if where == "system":
        turns = _turns(texts)
        return (system_text, question, turns, []) if turns is not None else None
    text = texts[where][1]
    after = texts[where + 1:]
    if not after or after[0][0] != "assistant":
        return None
    if _ends_with_block(text):  # the document alone, then its acknowledgement
        document, conversation = text, texts[:where] + after[1:]
    elif (split := _split_one_message(text)) is not None:  # the first turn's question holds the document
        document, conversation = split[0], texts[:where] + [("user", split[1])] + after
    else:
        return None
    turns = _turns(conversation)
    return (document, question, turns, systems) if turns is not None else None


def _refuse_unsupported(body: dict) -> list[str]:
    """The ignored parameters present; RequestError for one snapkv does not honour, set to a value that matters."""
    optional_tools = (body.get("tool_choice", "auto") in ("auto", "none", None)
                      and body.get("function_call", "auto") in ("auto", "none", None))
    for name, value in body.items():
        if name in READ or name in IGNORED:
            continue
        if name in OPTIONAL_TOOLS and optional_tools and isinstance(value, (list, str, bool, type(None))):
            continue
        if name in NEUTRAL and any(value == neutral and type(value) is type(neutral) or value is neutral
                                   for neutral in NEUTRAL[name]):
            continue
        what = "is not supported by snapkv" if name in NEUTRAL else "is not a parameter snapkv knows"
        raise RequestError(f"{name}={value!r} {what}; leave it out", param=name, code="unsupported_parameter")
    return sorted(name for name in body if name in IGNORED or name in OPTIONAL_TOOLS and optional_tools
                  and body[name] not in (None, [], "none", "auto", False, True))


def parse_chat_request(body) -> ChatRequest:
    """A /v1/chat/completions body (decoded JSON) -> ChatRequest; RequestError where it is not one snapkv answers."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    ignored = _refuse_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required (GET /v1/models lists the one served)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"at most {MAX_MESSAGES} messages are taken, not {len(messages)}", param="messages")
    systems, texts = [], []  # texts: (role, text) of the user and assistant messages, in order
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{index}] must be an object", param=f"messages[{index}]")
        role = message.get("role")
        if role in SYSTEM_ROLES:
            systems.append(_text_of(message.get("content"), index))
        elif role in TEXT_ROLES:
            texts.append((role, _text_of(message.get("content"), index)))
        else:
            raise RequestError(f"messages[{index}].role {role!r} is not one snapkv answers (system, developer, user, "
                               "assistant)", param=f"messages[{index}].role", code="unsupported_role")
    if not texts or texts[-1][0] != "user":
        raise RequestError("the last user or assistant message must be the user's question", param="messages")
    question = texts[-1][1]
    if not question.strip():
        raise RequestError("the question (the last user message) is empty", param="messages")
    layout = _layout(systems, texts[:-1], question)
    if layout is not None and layout[0].strip():
        document, question, turns, systems = layout
    else:
        document, turns, systems = _document_and_turns(texts[:-1], systems)
    if not document.strip():
        raise RequestError("snapkv answers questions about a document: send the document in a user message before "
                           "the question (the last user message)", param="messages", code="no_document")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}:
        raise RequestError("stream_options takes include_usage only", param="stream_options")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": limit}, "max_tokens", int, 1, MAX_TOKENS_CAP, DEFAULT_MAX_TOKENS)
    temperature = _number(body, "temperature", float, 0.0, 2.0, 0.0)
    top_p = _number(body, "top_p", float, 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be above 0", param="top_p")
    seed = _number(body, "seed", int, -(2 ** 63), 2 ** 63 - 1, None)
    return ChatRequest(model=model, system="\n\n".join(systems) if systems else None, document=document,
                       question=question, turns=turns, max_tokens=max_tokens,
                       sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed), stop=_stop(body),
                       stream=stream, include_usage=bool(options.get("include_usage")), cite=_cite(body),
                       ignored=ignored)
