"""The OpenAI-compatible HTTP API over a ChatService, as an ASGI app (Starlette; `snapkv serve --http` runs it with
uvicorn): POST /v1/chat/completions (streamed by server-sent events or not), GET /v1/models, GET /health.

Starlette rather than FastAPI: the API is three routes whose bodies are checked by hand (snapkv.serving.chat_request
says what each field may hold, and refuses what snapkv does not do), so FastAPI's pydantic models would add a second
description of the same body and a dependency; Starlette is the maintained ASGI toolkit FastAPI itself is built on,
and uvicorn its usual server.

Requests run one at a time on one worker thread (a model answers one question at a time); up to `queue` more wait
their turn, and one past that is answered 429 at once. A client that goes away (a closed stream, or a dropped
connection while it waited) stops its answer between two tokens, or before it begins. Bodies are read up to
MAX_BODY_BYTES. With an API key, every /v1 route wants `Authorization: Bearer KEY`.
"""

import asyncio
import hmac
import json
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from snapkv.serving.chat_request import ChatRequest, RequestError, parse_chat_request
from snapkv.serving.chat_service import ChatService, Finished

MAX_BODY_BYTES = 32 << 20   # a request's JSON: a long document's text (a 128k-token one is about 0.5 MB)
DEFAULT_QUEUE = 8           # requests that may wait for the one being answered
POLL_SECONDS = 0.25         # how often a waiting request checks whether its client is still there
MODEL_ALIAS = "snapkv"      # answers as the served model too
MAX_HEAD_BYTES = 64 << 10   # a request line and its headers (a browser sends under 8 KB, a long bearer key under 1 KB)


SHOWN_CHARS = 80  # the most of a client's own value an error message repeats


def shown(value: str) -> str:
    """A client's value as an error message quotes it: repr, cut to SHOWN_CHARS characters."""
    return repr(value) if len(value) <= SHOWN_CHARS else repr(value[:SHOWN_CHARS]) + f"... ({len(value)} characters)"


def server_config(asgi, **settings):
    """uvicorn's settings for this app: h11 with a bound on a request's head (httptools reads headers of any size:
    48 MB were taken, at a cost growing with the square of their size; past MAX_HEAD_BYTES h11 answers 431 and
    closes), no access log, 5 s for answers under way when stopped."""
    import uvicorn

    return uvicorn.Config(asgi, log_level="warning", access_log=False, timeout_graceful_shutdown=5, http="h11",
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, **settings)


def error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": "5"} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def unauthorized() -> JSONResponse:
    return error_response(RequestError("a valid API key is required: Authorization: Bearer KEY (the key snapkv serve "
                                       "was started with)", status=401, code="invalid_api_key"))


def key_matches(request: Request, key: bytes | None) -> bool:
    """Whether the request may be answered: no key is set, or it sends `Authorization: Bearer KEY` (compared in
    constant time)."""
    if key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)


async def read_body(request: Request) -> bytes:
    """The request's body, read up to MAX_BODY_BYTES (a declared Content-Length past it is refused unread)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise RequestError(f"the body is over {MAX_BODY_BYTES >> 20} MB", status=413, code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError(f"the body is over {MAX_BODY_BYTES >> 20} MB", status=413, code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # it left (or broke its chunked body) before the end: no one to answer
        raise RequestError("the client went away before its body ended", code="client_disconnected") from None
    return b"".join(chunks)


async def _json_body(request: Request):
    body = await read_body(request)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise RequestError("the body is not valid JSON", code="invalid_json") from None


class _Answering:
    """One request on its way through the worker: its events (text pieces, then the end or an error) arrive on
    the event loop's queue; `cancel` asks the worker to stop."""

    def __init__(self, service: ChatService, chat: ChatRequest, executor: ThreadPoolExecutor,
                 on_end: Callable[[bool, Finished | None], None]) -> None:
        """on_end(cancelled, finished) is called on the event loop when the worker is done with the request."""
        self.cancel = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self._checked = time.monotonic()  # when the client was last seen connected
        loop = asyncio.get_running_loop()

        def put(kind: str, value) -> None:
            loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

        def work() -> None:
            finished = None
            try:
                finished = service.run(chat, self.cancel, lambda text: put("text", text))
                put("end", finished)
            except RequestError as error:
                put("error", error)
            except Exception as error:  # a bug or a failing device: the request fails, the server goes on
                print(f"snapkv server: a request failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                put("error", RequestError(f"the answer failed: {type(error).__name__}", status=500,
                                          code="internal_error", kind="server_error"))
            finally:
                loop.call_soon_threadsafe(on_end, self.cancel.is_set(), finished)
            service.save_pending()  # the document's cache, saved once the answer is out

        self.done = loop.run_in_executor(executor, work)

    async def next_event(self, request: Request) -> tuple[str, object] | None:
        """The next event, or None where the client has gone away (the answer is then cancelled): asked every
        POLL_SECONDS, whether events keep coming or not (a closed stream is not always an error on sending)."""
        while True:
            if time.monotonic() - self._checked >= POLL_SECONDS:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    self.cancel.set()
                    return None
            try:
                return await asyncio.wait_for(self.events.get(), POLL_SECONDS)
            except asyncio.TimeoutError:
                continue


class OpenAIApp:
    """The routes, the queue and the key around one ChatService."""

    def __init__(self, service: ChatService, api_key: str | None = None, queue: int = DEFAULT_QUEUE) -> None:
        self.service = service
        self._key = api_key.encode() if api_key else None
        self._limit = queue + 1  # the one answered and those waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapkv-model")
        self.in_flight = 0
        self.answered = 0
        self.cancelled = 0
        self.last_tokens = 0    # completion tokens of the last answer that ended (cancelled or not)
        self.asgi = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ])

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.service.model_id, "in_flight": self.in_flight,
                             "answered": self.answered, "cancelled": self.cancelled, "last_tokens": self.last_tokens})

    async def models(self, request: Request) -> JSONResponse:
        if not key_matches(request, self._key):
            return unauthorized()
        return JSONResponse({"object": "list", "data": [{"id": self.service.model_id, "object": "model",
                                                         "created": 0, "owned_by": "snapkv"}]})

    def _ended(self, cancelled: bool, finished: Finished | None) -> None:
        self.in_flight -= 1
        self.answered += finished is not None
        self.cancelled += cancelled
        self.last_tokens = finished.usage.completion_tokens if finished else 0

    async def chat_completions(self, request: Request) -> Response:
        if not key_matches(request, self._key):
            return unauthorized()
        try:
            chat = parse_chat_request(await _json_body(request))
            if chat.model not in (self.service.model_id, MODEL_ALIAS):
                raise RequestError(f"model {shown(chat.model)} is not served here; this server answers with "
                                   f"{self.service.model_id!r}", status=404, param="model", code="model_not_found")
            if self.in_flight >= self._limit:
                raise RequestError(f"{self.in_flight} requests are already being answered or waiting; try again "
                                   "shortly", status=429, code="queue_full", kind="rate_limit_error")
        except RequestError as error:
            return error_response(error)
        self.in_flight += 1
        answering = _Answering(self.service, chat, self._executor, self._ended)
        first = await answering.next_event(request)  # an error before any text is a plain error response
        if first is None:
            return Response(status_code=499)
        if first[0] == "error":
            return error_response(first[1])
        identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.service.model_id}
        if chat.stream:
            return StreamingResponse(self._chunks(request, answering, chat, identity, first),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, event = [], first
        while event is not None and event[0] == "text":
            texts.append(event[1])
            event = await answering.next_event(request)
        if event is None or event[1] is None:  # the client left
            return Response(status_code=499)
        if event[0] == "error":
            return error_response(event[1])
        finished: Finished = event[1]
        return JSONResponse({**identity, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(texts)}, "logprobs": None,
            "finish_reason": finished.finish_reason}], "usage": finished.usage.body(), "snapkv": finished.details})

    async def _chunks(self, request: Request, answering: _Answering, chat: ChatRequest, identity: dict, first):
        """The answer as server-sent events: a role, the text pieces, the finish reason, the usage where asked,
        then [DONE]. Leaving early (the client closed the stream) cancels the answer."""
        def event(delta: dict | None, finish: str | None = None, **extra) -> str:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            return f"data: {json.dumps({**identity, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

        finished = None
        try:
            yield event({"role": "assistant", "content": ""})
            item = first
            while item is not None and item[0] == "text":
                yield event({"content": item[1]})
                item = await answering.next_event(request)
            if item is None or item[1] is None:  # the client left
                return
            if item[0] == "error":
                yield f"data: {json.dumps(item[1].body())}\n\n"
            else:
                finished = item[1]
                yield event({}, finished.finish_reason, snapkv=finished.details)
                if chat.include_usage:
                    yield event(None, usage=finished.usage.body())
            yield "data: [DONE]\n\n"
        finally:
            if finished is None:
                answering.cancel.set()  # the client went away, or the answer failed: no more tokens
