"""`snapkv serve --http --ray`: the OpenAI-compatible API as a Ray Serve application, past one machine.

    Router (one replica)      Ray Serve's HTTP ingress: checks the key, reads the body (bounded), names the
                              request's document by a hash of its system message and its beginning, and hands the request
                              on with that name as Serve's multiplexed model id, so that the follow-ups about one
                              document go to the replica that holds its cache; a replica that dies before it answers
                              is passed over (the request is sent again, to another or a restarted replica)
    Answerer (N replicas)     each loads the model once and runs the very app `serve --http` runs (OpenAIApp over a
                              ChatService) over a store every replica can read (a folder or an fsspec URL:
                              snapkv.storage.remote); a replica that does not hold a document's cache reads it from
                              the store, or makes and publishes it

The request travels to an answerer as plain values (method, path, headers, body) and its response comes back as the
ASGI messages the app sends, so streaming, errors, the key check and a client that leaves behave as with one process.
Each response names the replica that answered it (header x-snapkv-replica). Needs `pip install snapkv[cluster]`.
"""

import asyncio
import hashlib
import json
import sys
from dataclasses import dataclass

from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from snapkv.serving.chat_request import RequestError, parse_chat_request
from snapkv.serving.openai_app import error_response, key_matches, read_body, unauthorized

HELD_PER_REPLICA = 4         # documents a replica keeps loaded, and says it holds so that their follow-ups come to it
RELAY_ATTEMPTS = 3           # a request is sent this many times where its replica dies before answering
REPLICA_HEADER = "x-snapkv-replica"
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve logs every request at INFO otherwise
CHAT_PATH = "/v1/chat/completions"
NAMED_CHARACTERS = 2048      # of a document, what names it for routing (document_name)
ROUTER_REQUESTS = 1024       # requests the router relays at once, and as many more waiting; past that Serve says 503


@dataclass(frozen=True)
class ReplicaSettings:
    """What each answerer is started with: the `serve --http` options."""

    model: str | None
    device: str
    dtype: str
    store: str | None         # a folder or an fsspec URL; None: SNAPKV_STORE, else each machine's own store
    api_key: str | None
    queue: int
    truncate: str | None
    cite: bool


def document_name(body: bytes) -> str:
    """The routing name of a chat request's document: a hash of its system message and the document's first
    NAMED_CHARACTERS (about its first two chunks of tokens, snapkv.storage.prefixes), so that every question about one
    document, in any conversation, has one name, and so has a document that grows or ends differently: the replica
    that holds the cache it shares a prefix with; "" for a body that is not a chat request snapkv answers (any replica
    refuses it)."""
    try:
        chat = parse_chat_request(json.loads(body))
    except (ValueError, RecursionError):  # RequestError too
        return ""
    return hashlib.sha256(json.dumps([chat.system, chat.document[:NAMED_CHARACTERS]]).encode()).hexdigest()[:32]


@serve.deployment
class Answerer:
    """One replica: the model loaded once, the API app of `serve --http` around it."""

    def __init__(self, settings: ReplicaSettings) -> None:
        from snapkv.compression.config import DEFAULTS
        from snapkv.engine.models import load_model
        from snapkv.serving.chat_service import ChatService
        from snapkv.serving.openai_app import OpenAIApp
        from snapkv.storage.remote import open_store

        loaded = load_model(settings.model, settings.device, settings.dtype)
        # A GPU keeps one document's cache loaded (a long one's takes gigabytes); the others it is routed stay in
        # this machine's store (the shared store's local copy), read back without fetching
        kept = 1 if loaded.device.type == "cuda" else HELD_PER_REPLICA
        service = ChatService(loaded, DEFAULTS, open_store(settings.store), truncate=settings.truncate,
                              cite=settings.cite, kept_in_memory=kept)
        self.app = OpenAIApp(service, api_key=settings.api_key, queue=settings.queue)
        self.replica = serve.get_replica_context().replica_id.unique_id

    def stats(self) -> dict:
        """This replica's counts, as its /health says them."""
        return {"replica": self.replica, "in_flight": self.app.in_flight, "answered": self.app.answered,
                "cancelled": self.app.cancelled, "last_tokens": self.app.last_tokens}

    @serve.multiplexed(max_num_models_per_replica=HELD_PER_REPLICA)
    async def hold(self, name: str) -> str:
        """Marks a document as held here, so that Serve routes its follow-ups to this replica (the cache itself is
        the ChatService's, which keeps as many documents)."""
        return name

    async def relay(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes):
        """The app's ASGI messages for one request: its start (status, headers), then its body pieces."""
        if name := serve.get_multiplexed_model_id():
            await self.hold(name)
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.replica.encode())]}
            await sent.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": headers, "client": None, "server": None}
        running = asyncio.create_task(self.app.asgi(scope, receive, send))
        try:
            while True:
                getting = asyncio.create_task(sent.get())
                done, _ = await asyncio.wait({getting, running}, return_when=asyncio.FIRST_COMPLETED)
                if getting not in done:  # the app ended: what it sent is all there is
                    getting.cancel()
                    while not sent.empty():
                        yield sent.get_nowait()
                    running.result()
                    return
                message = getting.result()
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    return
        finally:  # the client went away (Serve cancels this generator): the app sees a disconnect and stops
            gone.set()
            if not running.done():
                await asyncio.wait({running}, timeout=5)


@serve.deployment
class Router:
    """The HTTP ingress: every request to the answerer that holds its document."""

    def __init__(self, answerers, api_key: str | None, route_by_document: bool = True) -> None:
        """route_by_document False: any replica answers any request (Serve's own choice; measured against)."""
        self.answerers = answerers
        self._key = api_key.encode() if api_key else None
        self._route_by_document = route_by_document

    async def _start(self, request: Request, body: bytes, name: str):
        """(the response's start message, the rest of its messages), sent again where the replica died first."""
        failure = None
        for attempt in range(1, RELAY_ATTEMPTS + 1):
            handle = self.answerers.options(stream=True, **({"multiplexed_model_id": name} if name else {}))
            messages = handle.relay.remote(request.method, request.url.path, list(request.headers.raw), body)
            try:
                return await messages.__anext__(), messages
            except asyncio.CancelledError:  # the client went away while the replica answered
                messages.cancel()
                raise
            except BackPressureError:
                raise RequestError("every replica is busy and the requests waiting for them are at the limit "
                                   "(serve --queue); try again shortly", status=429, code="queue_full",
                                   kind="rate_limit_error") from None
            except Exception as error:  # the replica died or could not be reached: nothing was answered yet
                failure = error
                print(f"snapkv router: a replica failed before answering ({type(error).__name__}; try {attempt} of "
                      f"{RELAY_ATTEMPTS})", file=sys.stderr, flush=True)
        raise RequestError(f"no replica could answer ({type(failure).__name__}); try again shortly", status=503,
                           code="unavailable", kind="server_error")

    async def __call__(self, request: Request) -> Response:
        if request.url.path.startswith("/v1/") and not key_matches(request, self._key):
            return unauthorized()  # refused here: an unauthorized request never takes a replica's routing slot
        try:
            body = await read_body(request)
            is_chat = request.url.path == CHAT_PATH and request.method == "POST" and self._route_by_document
            start, messages = await self._start(request, body, document_name(body) if is_chat else "")
        except RequestError as error:
            return error_response(error)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])
                   if k.lower() != b"content-length"}
        try:
            first = await anext(messages, None)
        except asyncio.CancelledError:
            messages.cancel()
            raise
        if first is None or not first.get("more_body"):  # the whole body in one message: a plain response
            return Response(first.get("body", b"") if first else b"", status_code=start["status"], headers=headers)

        async def pieces():
            ended = False
            try:
                yield first.get("body", b"")
                async for message in messages:
                    if message.get("body"):
                        yield message["body"]
                ended = True
            finally:
                if not ended:  # the client went away: Starlette then ends this request without an error, so Ray's
                    messages.cancel()  # own cancel may never reach the replica, which would answer on unheard

        return StreamingResponse(pieces(), status_code=start["status"], headers=headers)


def application(settings: ReplicaSettings, replicas: int | tuple[int, int], replica_cpus: float,
                replica_gpus: float, route_by_document: bool = True):
    """The Serve application: a router in front of the answerers, `replicas` of them (or autoscaled between the
    bounds of a pair), each reserving `replica_cpus` CPUs and `replica_gpus` GPUs."""
    scale = ({"num_replicas": replicas} if isinstance(replicas, int) else
             {"autoscaling_config": {"min_replicas": replicas[0], "max_replicas": replicas[1],
                                     "target_ongoing_requests": 2}})
    most = replicas if isinstance(replicas, int) else replicas[1]
    answerers = Answerer.options(
        # One request at a time on a replica: one that waits there could not go to an idle replica, which reads a
        # held document's cache from the store in a fraction of a prefill. Serve holds the others, `queue` a replica.
        **scale, max_ongoing_requests=1, max_queued_requests=max(1, settings.queue * most),
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus}, logging_config=QUIET,
    ).bind(settings)
    router = Router.options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=ROUTER_REQUESTS,
                            max_queued_requests=ROUTER_REQUESTS, logging_config=QUIET)
    return router.bind(answerers, settings.api_key, route_by_document)

