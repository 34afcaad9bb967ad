"""snapkv serve: keep the model loaded between commands, as ollama does, so that a follow-up `snapkv ask`
costs what the REPL pays instead of a process start, imports and a model load.

`snapkv ask` looks for the server's socket first and, when one answers, runs there: the same code, the same
output on stdout and stderr, the same exit code. The socket lives in the snapkv home, readable by its user
only (and connections from other users are refused); the server exits after --idle-timeout seconds without
a request, or on `snapkv serve --stop`.

Protocol, one JSON object per line: the client sends {"argv", "cwd", "env"} (or {"stop": true}); the server
answers with {"out": text} and {"err": text} as the command writes, then {"exit": code}.
"""

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from snapkv.paths import snapkv_home

DEFAULT_IDLE_SECONDS = 900
IN_SERVER = False  # True in the server process: its commands run there, never forwarded again
# Environment a command reads, passed from the client to the server for the request.
FORWARDED_ENV = ("SNAPKV_MODEL", "SNAPKV_DEBUG", "SNAPKV_PDF_TIMEOUT", "SNAPKV_PDF_MEMORY_MB", "SNAPKV_NOLOG",
                 "COLUMNS", "NO_COLOR")


def socket_path() -> Path:
    """The server's socket: in the snapkv home, or, where that path is too long for a Unix socket, in a
    private folder of the user's named by the home."""
    home = snapkv_home()
    path = home / "serve.sock"
    if len(str(path)) < 100:
        return path
    folder = Path(tempfile.gettempdir()) / f"snapkv-{os.getuid()}"
    return folder / f"{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]}.sock"


# ---------------------------------------------------------------------------------------------- client

def _send(connection: socket.socket, message: dict) -> None:
    connection.sendall((json.dumps(message) + "\n").encode())


def _connect(timeout: float = 2.0) -> socket.socket | None:
    path = socket_path()
    if not path.exists():
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout)
    try:
        connection.connect(str(path))
    except OSError:  # no server behind the socket (it died): run locally
        connection.close()
        return None
    connection.settimeout(None)
    return connection


def run_remotely(argv: list[str]) -> int | None:
    """Run a command line on the server; its exit code, or None when no server is running."""
    connection = _connect()
    if connection is None:
        return None
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    try:
        _send(connection, {"argv": argv, "cwd": os.getcwd(), "env": env})
        for line in connection.makefile("r", encoding="utf-8"):
            message = json.loads(line)
            if "out" in message:
                sys.stdout.write(message["out"])
                sys.stdout.flush()
            elif "err" in message:
                sys.stderr.write(message["err"])
                sys.stderr.flush()
            elif "exit" in message:
                return int(message["exit"])
    except KeyboardInterrupt:
        print("snapkv: interrupted; nothing half-written was left behind", file=sys.stderr)
        return 130
    except OSError:
        pass
    finally:
        connection.close()
    print("snapkv: error: the snapkv server stopped before the command ended; run it again (it runs here when no "
          "server answers)", file=sys.stderr)
    return 1


def stop_server() -> bool:
    connection = _connect()
    if connection is None:
        return False
    with connection:
        _send(connection, {"stop": True})
        connection.makefile("r").readline()
    return True


# ---------------------------------------------------------------------------------------------- server

class ClientGone(Exception):
    """The client went away (Ctrl-C): the command stops at its next output."""


class _Frames(io.TextIOBase):
    """A text stream whose writes go to the client as {"out"|"err": text} messages."""

    def __init__(self, connection: socket.socket, kind: str) -> None:
        self._connection, self._kind, self.gone = connection, kind, False

    def write(self, text: str) -> int:
        if self.gone:
            return len(text)
        try:
            _send(self._connection, {self._kind: text})
        except OSError as error:
            self.gone = True
            raise ClientGone() from error
        return len(text)

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def _peer_is_this_user(connection: socket.socket) -> bool:
    """Linux tells who connected (SO_PEERCRED); elsewhere the socket's mode (0600) alone keeps others out."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid == os.getuid()


@contextlib.contextmanager
def _request_context(request: dict):
    """The client's folder and environment for the length of one request."""
    previous_cwd, previous_env = os.getcwd(), dict(os.environ)
    try:
        os.chdir(request.get("cwd") or previous_cwd)
        for name in FORWARDED_ENV:
            os.environ.pop(name, None)
        os.environ.update({k: v for k, v in (request.get("env") or {}).items() if k in FORWARDED_ENV})
        yield
    finally:
        os.chdir(previous_cwd)
        os.environ.clear()
        os.environ.update(previous_env)


def _handle(connection: socket.socket) -> bool:
    """One request; False when it asks the server to stop."""
    from .app import run

    line = connection.makefile("r", encoding="utf-8").readline()
    if not line:  # a probe (serve --status): connected and left
        return True
    request = json.loads(line)
    if request.get("stop"):
        _send(connection, {"exit": 0})
        return False
    argv = request.get("argv") or []
    if not argv or argv[0] != "ask":  # the server runs `ask` only; anything else runs where it was typed
        _send(connection, {"err": "snapkv: error: the server runs `snapkv ask` only\n"})
        _send(connection, {"exit": 2})
        return True
    out, err = _Frames(connection, "out"), _Frames(connection, "err")
    with _request_context(request), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run(argv)
        except ClientGone:
            code = 130
    if not out.gone and not err.gone:
        with contextlib.suppress(OSError):
            _send(connection, {"exit": code})
    return True


def _listen(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent != snapkv_home():
        path.parent.chmod(0o700)
    path.unlink(missing_ok=True)  # a socket left by a server that died
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)  # created 0600: only this user can connect
    try:
        server.bind(str(path))
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    server.listen(8)
    return server


def serve_forever(idle_seconds: float, preload: Optional[str], device: str, dtype: str) -> None:
    """Answer requests one at a time until idle for `idle_seconds` or asked to stop."""
    import snapkv.models as models

    global IN_SERVER
    IN_SERVER = True
    models.MODEL_POOL = models.ModelPool()
    models.MODEL_POOL.get(preload, device=device, dtype=dtype)  # the first ask is then fast too
    path = socket_path()
    server = _listen(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.settimeout(idle_seconds)
        while True:
            try:
                connection, _ = server.accept()
            except socket.timeout:
                return
            with connection:
                if not _peer_is_this_user(connection):
                    continue
                try:
                    if not _handle(connection):
                        return
                except (OSError, ValueError) as error:  # a client that left or sent nonsense: the server goes on
                    print(f"snapkv server: a request failed: {error}", file=sys.stderr)
    finally:
        server.close()
        path.unlink(missing_ok=True)


def _detach() -> bool:
    """Fork into the background (double fork, own session, output to serve.log); True in the server."""
    if os.fork():
        return False
    os.setsid()
    if os.fork():
        os._exit(0)
    log = open(snapkv_home() / "serve.log", "a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    return True


def serve(
    stop: bool = typer.Option(False, "--stop", help="Stop the running server."),
    status: bool = typer.Option(False, "--status", help="Say whether a server is running, and where."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Run in the background (output to serve.log in the "
                                                              "snapkv home)."),
    idle_timeout: float = typer.Option(DEFAULT_IDLE_SECONDS, min=1, help="Exit after this many seconds without a "
                                                                          "request."),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="SNAPKV_MODEL",
                                        help="The model to load at start (default: the embedded one)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
) -> None:
    """Keep the model loaded so that `snapkv ask` answers without starting over (a local Unix socket).

    While it runs, `snapkv ask` runs there: same output, exit codes and --json; `ask --no-server` or
    SNAPKV_NO_SERVER=1 runs where it is typed instead.
    """
    path = socket_path()
    if stop:
        print("stopped the snapkv server" if stop_server() else "no snapkv server is running")
        return
    connection = _connect()
    if status:
        print(f"a snapkv server is running on {path}" if connection else "no snapkv server is running")
        if connection:
            connection.close()
        return
    if connection is not None:
        connection.close()
        print(f"a snapkv server is already running on {path}; stop it with snapkv serve --stop", file=sys.stderr)
        raise typer.Exit(1)
    if detach and not _detach():
        for _ in range(600):  # the parent waits until the server listens, so that the next ask finds it
            time.sleep(0.1)
            if (probe := _connect()) is not None:
                probe.close()
                print(f"snapkv server listening on {path} (idle timeout {idle_timeout:.0f} s); stop it with "
                      "snapkv serve --stop")
                return
        print("snapkv: error: the server did not start; see serve.log in the snapkv home", file=sys.stderr)
        raise typer.Exit(1)
    if not detach:
        print(f"snapkv server: loading the model, then listening on {path} (idle timeout {idle_timeout:.0f} s; "
              "Ctrl-C or snapkv serve --stop to end)", file=sys.stderr)
    serve_forever(idle_timeout, model, device, dtype)
