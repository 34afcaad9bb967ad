"""The local server (`snapkv serve`): the model loaded once, `snapkv ask` command lines read from a Unix socket in
the snapkv home and run one at a time, each one's output streamed back as it is written (snapkv_cli.local_protocol).

The server runs a command through the `run_command` it is given (snapkv_cli.app.run, handed down by the command line
that started it), so that this module never imports the app. It exits after its idle timeout, on
`snapkv serve --stop`, or on SIGTERM.
"""

import contextlib
import io
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from snapkv.base.ownership import private_folder
from snapkv.base.paths import snapkv_home

from .local_protocol import BadRequest, FORWARDED_ENV, lock_path, peer_uid, read_request, send, socket_path

SEND_SECONDS = 60.0            # a client has this long to take each piece of output (one that stops reading is dropped)
MAX_WAITING = 32               # connections read at once; more are turned away
IN_SERVER = False  # True in the server process: its commands run there, never forwarded again
CommandRunner = Callable[[list[str]], int]  # a command line -> its exit code


class ClientGone(Exception):
    """The client went away (Ctrl-C): the command stops at its next output."""


class _Frames(io.TextIOBase):
    """A text stream whose writes go to the client as {"out"|"err": text} messages; a terminal when the
    client's stream is one. Both streams of a request share `lock` (a progress display writes from a thread
    of its own while the answer is printed), so that no two messages interleave on the socket."""

    def __init__(self, connection: socket.socket, kind: str, lock: threading.Lock, terminal: bool) -> None:
        self._connection, self._kind, self._lock, self._terminal = connection, kind, lock, terminal
        self.gone = False

    def write(self, text: str | bytes) -> int:
        if isinstance(text, (bytes, bytearray)):  # click writes bytes where it takes the stream for a binary one
            text = bytes(text).decode("utf-8", errors="replace")
        if self.gone or not text:
            return len(text)
        try:
            with self._lock:
                send(self._connection, {self._kind: text})
        except OSError as error:  # gone, or not reading for SEND_SECONDS
            self.gone = True
            raise ClientGone() from error
        return len(text)

    def isatty(self) -> bool:
        return self._terminal

    @property
    def encoding(self) -> str:
        return "utf-8"


@contextlib.contextmanager
def _request_context(request: dict):
    """The client's folder and environment for the length of one request."""
    previous_cwd, previous_env = os.getcwd(), dict(os.environ)
    try:
        os.chdir(request["cwd"])
        for name in FORWARDED_ENV:
            os.environ.pop(name, None)
        os.environ.update({k: v for k, v in request.get("env", {}).items() if k in FORWARDED_ENV})
        yield
    finally:
        os.chdir(previous_cwd)
        os.environ.clear()
        os.environ.update(previous_env)


def _answer(connection: socket.socket, request: dict, run_command: CommandRunner) -> None:
    """Run one `ask` with its output streamed to the client."""
    argv = request["argv"]
    if argv[0] != "ask":  # the server runs `ask` only; anything else runs where it was typed
        send(connection, {"err": "snapkv: error: the server runs `snapkv ask` only\n"})
        send(connection, {"exit": 2})
        return
    connection.settimeout(SEND_SECONDS)
    lock, terminal = threading.Lock(), request.get("terminal", [])
    out, err = _Frames(connection, "out", lock, "out" in terminal), _Frames(connection, "err", lock, "err" in terminal)
    with _request_context(request), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_command(argv)
        except ClientGone:
            code = 130
    if not out.gone and not err.gone:
        with contextlib.suppress(OSError):
            send(connection, {"exit": code})


class _Receiver:
    """Reads requests on threads of their own, so that a client that connects and sends nothing holds up no
    one; complete requests wait in a queue for the one thread that runs the model."""

    def __init__(self) -> None:
        self.requests: "queue.Queue[tuple[socket.socket, dict]]" = queue.Queue()
        self.stopping = threading.Event()
        self.busy = threading.Event()   # a request is running (a stop then signals the server)
        self.last_activity = time.monotonic()  # of the last connection or answer (the idle timeout counts from it)
        self._reading = threading.BoundedSemaphore(MAX_WAITING)

    def take(self, connection: socket.socket) -> None:
        self.last_activity = time.monotonic()
        if not self._reading.acquire(blocking=False):
            connection.close()  # too many at once: turned away, not queued without bound
            return
        threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        try:
            if peer_uid(connection) not in (None, os.getuid()):
                connection.close()
                return
            request = read_request(connection)
            if request is None:  # a probe (serve --status): connected and left
                connection.close()
            elif request.get("stop"):
                with contextlib.suppress(OSError):
                    send(connection, {"exit": 0})
                connection.close()
                self.stopping.set()
                if self.busy.is_set():  # stop now, not after the answer in progress
                    os.kill(os.getpid(), signal.SIGTERM)
            else:
                self.requests.put((connection, request))
        except BadRequest as error:
            print(f"snapkv server: refused a request: {error}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                send(connection, {"err": f"snapkv: error: bad request to the server: {error}\n"})
                send(connection, {"exit": 2})
            connection.close()
        except OSError as error:
            print(f"snapkv server: a client left: {error}", file=sys.stderr, flush=True)
            connection.close()
        finally:
            self._reading.release()


def _listen(path: Path) -> socket.socket:
    """The listening socket, 0600 in a folder of this user's; called with the home's lock held, so a socket
    already there was left by a server that died."""
    if path.parent == snapkv_home():
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        private_folder(path.parent)
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)  # created 0600: only this user can connect
    try:
        server.bind(str(path))
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    server.listen(MAX_WAITING)
    return server


@contextlib.contextmanager
def one_server_per_home():
    """The home's server lock, held for the server's life (with its pid for `serve --stop`); AlreadyServing
    when another server holds it."""
    import fcntl

    lock = os.open(lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise AlreadyServing() from None
        os.ftruncate(lock, 0)
        os.write(lock, str(os.getpid()).encode())
        yield
    finally:
        os.close(lock)  # releases the lock


class AlreadyServing(Exception):
    """Another server runs for this home."""


def _remove_own_socket(path: Path, made: os.stat_result) -> None:
    """Remove the socket only if it is still the one this server made (never a later server's)."""
    with contextlib.suppress(OSError):
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
            path.unlink()


def serve_forever(idle_seconds: float, preload: Optional[str], device: str, dtype: str,
                  run_command: CommandRunner) -> None:
    """Answer requests one at a time, each by run_command, until idle for `idle_seconds` or asked to stop."""
    import snapkv.engine.models as models

    global IN_SERVER
    IN_SERVER = True
    models.MODEL_POOL = models.ModelPool()
    models.MODEL_POOL.get(preload, device=device, dtype=dtype)  # the first ask is then fast too
    path = socket_path()
    server = _listen(path)
    made = os.lstat(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    receiver = _Receiver()
    server.settimeout(0.2)
    # connections are taken on a thread of their own, so that a stop is read while an answer runs
    threading.Thread(target=_accept_forever, args=(server, receiver), daemon=True).start()
    try:
        while not receiver.stopping.is_set():
            try:
                connection, request = receiver.requests.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() - receiver.last_activity > idle_seconds:
                    return
                continue
            receiver.busy.set()
            try:
                with connection:
                    _answer(connection, request, run_command)
            except Exception as error:  # one request's failure is logged; the server goes on
                print(f"snapkv server: a request failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            finally:
                receiver.busy.clear()
                receiver.last_activity = time.monotonic()
    finally:
        server.close()
        _remove_own_socket(path, made)


def _accept_forever(server: socket.socket, receiver: "_Receiver") -> None:
    """Hand every connection to the receiver until the server stops or its socket is closed."""
    while not receiver.stopping.is_set():
        try:
            connection, _ = server.accept()
        except socket.timeout:
            continue
        except OSError:  # closed: the server is ending
            return
        receiver.take(connection)


def detach() -> bool:
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
