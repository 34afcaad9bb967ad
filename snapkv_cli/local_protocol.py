"""The local server's wire protocol (snapkv_cli.local_client speaks it, snapkv_cli.local_server answers it): where
the socket lives, one JSON object per line, and the checks every request passes.

The client sends {"argv", "cwd", "env", "terminal"} (or {"stop": true}); "terminal" lists which of the client's
"out" and "err" are terminals, so that progress is drawn as it would be there. The server answers with
{"out": text} and {"err": text} as the command writes, then {"exit": code}.
"""

import hashlib
import json
import os
import socket
import struct
import tempfile
from pathlib import Path

from snapkv.base.paths import snapkv_home

# Environment a command reads, passed from the client to the server for the request.
FORWARDED_ENV = ("SNAPKV_MODEL", "SNAPKV_SYSTEM", "SNAPKV_ENGINE", "SNAPKV_KERNELS", "SNAPKV_DEBUG", "SNAPKV_PDF_TIMEOUT",
                 "SNAPKV_PDF_MEMORY_MB", "SNAPKV_NOLOG", "COLUMNS", "NO_COLOR")
MAX_REQUEST_BYTES = 1 << 20   # one request line: argv, folder and environment
REQUEST_SECONDS = 10.0         # a client has this long to send its request once connected


def socket_path() -> Path:
    """The server's socket: in the snapkv home, or, where that path is too long for a Unix socket, in a
    private folder of the user's named by the home."""
    home = snapkv_home()
    path = home / "serve.sock"
    if len(os.fsencode(path)) < 100:
        return path
    folder = Path(tempfile.gettempdir()) / f"snapkv-{os.getuid()}"
    return folder / f"{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]}.sock"


def lock_path() -> Path:
    return snapkv_home() / "serve.lock"


def send(connection: socket.socket, message: dict) -> None:
    connection.sendall((json.dumps(message) + "\n").encode())


def peer_uid(connection: socket.socket) -> int | None:
    """Who is at the other end (Linux: SO_PEERCRED); None where the platform does not say."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class BadRequest(ValueError):
    """A request the server does not take: answered with exit code 2, and the server goes on."""


def read_request(connection: socket.socket) -> dict | None:
    """One request line, bounded in bytes and time, checked: {"stop": true} or {"argv", "cwd", "env"}.
    None for a probe that connected and left; BadRequest for anything else."""
    connection.settimeout(REQUEST_SECONDS)
    received = bytearray()
    while b"\n" not in received:
        try:
            chunk = connection.recv(65536)
        except socket.timeout:
            raise BadRequest(f"no request within {REQUEST_SECONDS:.0f} s") from None
        if not chunk:
            if not received:
                return None
            break
        received += chunk
        if len(received) > MAX_REQUEST_BYTES:
            raise BadRequest(f"a request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        request = json.loads(bytes(received).split(b"\n", 1)[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("a request that is not one line of JSON") from None
    return validated(request)


def validated(request) -> dict:
    """The request if it has the expected keys and types; BadRequest naming what is wrong."""
    if not isinstance(request, dict):
        raise BadRequest("a request must be a JSON object")
    if request.get("stop") is True and set(request) == {"stop"}:
        return request
    if set(request) - {"argv", "cwd", "env", "terminal"}:
        raise BadRequest(f"unknown request keys {sorted(set(request) - {'argv', 'cwd', 'env', 'terminal'})}")
    argv, cwd, env = request.get("argv"), request.get("cwd"), request.get("env", {})
    terminal = request.get("terminal", [])
    if not isinstance(argv, list) or not argv or len(argv) > 10_000 or not all(isinstance(a, str) for a in argv):
        raise BadRequest("argv must be a non-empty list of texts")
    if not isinstance(cwd, str) or not os.path.isabs(cwd) or not os.path.isdir(cwd):
        raise BadRequest("cwd must be the absolute path of a folder")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) and "\0" not in v
                                            for k, v in env.items()):
        raise BadRequest("env must map names to texts")
    if not isinstance(terminal, list) or not all(t in ("out", "err") for t in terminal):
        raise BadRequest('terminal must list "out" and/or "err"')
    return request
