"""The Ray Serve router (snapkv.serving.ray_app.Router) on its own, with a stand-in for the answerers: what it does
with a replica's stream when the client goes away."""

import asyncio

import pytest

pytest.importorskip("ray.serve")

from snapkv.serving.ray_app import Router  # noqa: E402


class _Answer:
    """A replica's relayed messages: the response's start, then `pieces` body pieces (without end where None), then
    the body's end; records a cancel."""

    def __init__(self, pieces: int | None = None) -> None:
        self.pieces = pieces
        self.sent = 0
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        await asyncio.sleep(0.001)
        self.sent += 1
        if self.sent == 1:
            return {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        if self.pieces is not None and self.sent > self.pieces + 2:
            raise StopAsyncIteration
        if self.pieces is not None and self.sent == self.pieces + 2:
            return {"type": "http.response.body", "body": b"", "more_body": False}
        return {"type": "http.response.body", "body": b"piece ", "more_body": True}

    def cancel(self) -> None:
        self.cancelled = True


class _Answerers:
    """The answerers' handle as the router uses it: options(...).relay.remote(...) gives the answer's stream."""

    def __init__(self, answer: _Answer) -> None:
        self.relay = self
        self._answer = answer

    def options(self, **_):
        return self

    def remote(self, *_):
        return self._answer


def _routed(answer: _Answer, leave_after: int | None) -> list[bytes]:
    """The body pieces a client received through the router from `answer`, the client leaving after
    `leave_after` pieces (None: it reads to the end)."""
    from starlette.requests import Request

    router = Router.func_or_class(_Answerers(answer), api_key=None)
    received, bodies = [], []

    async def receive() -> dict:
        if not received:
            received.append(1)
            return {"type": "http.request", "body": b'{"model": "snapkv", "messages": []}', "more_body": False}
        while leave_after is None or len(bodies) < leave_after:
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    async def main() -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "headers": [], "root_path": "", "scheme": "http", "server": None,
                 "client": None, "http_version": "1.1", "asgi": {"version": "3.0"}}
        response = await router(Request(scope, receive))
        await asyncio.wait_for(response(scope, receive, send), 10)

    asyncio.run(main())
    return bodies


def test_a_client_that_leaves_a_stream_cancels_the_replicas_answer():
    # Starlette ends a streamed response without an error when the client disconnects, so the request ends
    # normally: Ray's own cancel of the request may then never reach the replica, and the router must cancel it
    answer = _Answer()
    bodies = _routed(answer, leave_after=3)
    assert len(bodies) >= 3 and set(bodies[:3]) == {b"piece "}
    assert answer.cancelled  # the replica is told to stop


def test_a_stream_read_to_its_end_is_not_cancelled():
    answer = _Answer(pieces=5)
    assert b"".join(_routed(answer, leave_after=None)) == b"piece " * 5
    assert not answer.cancelled
