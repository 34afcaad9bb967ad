"""snapkv serve: keep the model loaded between commands, as ollama does, so that a follow-up `snapkv ask`
costs what the REPL pays instead of a process start, imports and a model load.

`snapkv ask` looks for the server's socket first and, when one answers, runs there: the same code, the same
output on stdout and stderr, the same exit code. When none answers, the first `ask` starts one in the
background (its input checked first, so a mistyped path never waits on a model load) and runs there; that
server stops after SNAPKV_KEEP_ALIVE seconds without a request (300; 0 starts none). The socket lives in the snapkv home, readable by its user
only (and connections from other users are refused); the server exits after --idle-timeout seconds without
a request, or on `snapkv serve --stop`.

Protocol, one JSON object per line: the client sends {"argv", "cwd", "env", "terminal"} (or {"stop": true});
"terminal" lists which of the client's "out" and "err" are terminals, so that progress is drawn as it would
be there. The server answers with {"out": text} and {"err": text} as the command writes, then {"exit": code}.
"""

import contextlib
import contextvars
import hashlib
import io
import json
import os
import queue
import signal
import socket
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from snapkv.base.ownership import NotPrivate, private_folder, written_only_by_me
from snapkv.base.paths import snapkv_home

from .options import TruncateOption

DEFAULT_IDLE_SECONDS = 900
KEEP_ALIVE_SECONDS = 300       # the server the first `ask` leaves stops after this long without a request
IN_SERVER = False  # True in the server process: its commands run there, never forwarded again
# The command line being run (set by snapkv_cli.app.run): what the first `ask` hands to the server it starts.
COMMAND_LINE: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("snapkv_command_line", default=None)
# Environment a command reads, passed from the client to the server for the request.
FORWARDED_ENV = ("SNAPKV_MODEL", "SNAPKV_SYSTEM", "SNAPKV_ENGINE", "SNAPKV_KERNELS", "SNAPKV_DEBUG", "SNAPKV_PDF_TIMEOUT", "SNAPKV_PDF_MEMORY_MB", "SNAPKV_NOLOG",
                 "COLUMNS", "NO_COLOR")


MAX_REQUEST_BYTES = 1 << 20   # one request line: argv, folder and environment
REQUEST_SECONDS = 10.0         # a client has this long to send its request once connected
SEND_SECONDS = 60.0            # and to take each piece of output (a client that stops reading is dropped)
STOP_SECONDS = 10.0            # `serve --stop` waits this long for a reply, then signals the server itself
MAX_WAITING = 32               # connections read at once; more are turned away
SERVER_STATE_EXIT = 8          # serve --status with none running, or serve with one running (snapkv.base.errors.EXIT_CODES)


def socket_path() -> Path:
    """The server's socket: in the snapkv home, or, where that path is too long for a Unix socket, in a
    private folder of the user's named by the home."""
    home = snapkv_home()
    path = home / "serve.sock"
    if len(os.fsencode(path)) < 100:
        return path
    folder = Path(tempfile.gettempdir()) / f"snapkv-{os.getuid()}"
    return folder / f"{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]}.sock"


def _lock_path() -> Path:
    return snapkv_home() / "serve.lock"


# ---------------------------------------------------------------------------------------------- client

def _send(connection: socket.socket, message: dict) -> None:
    connection.sendall((json.dumps(message) + "\n").encode())


def _peer_uid(connection: socket.socket) -> int | None:
    """Who is at the other end (Linux: SO_PEERCRED); None where the platform does not say."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _trusted_socket(path: Path) -> bool:
    """The socket and its folder are this user's: a socket another user made must not receive our argv,
    folder and environment."""
    try:
        found, folder = os.lstat(path), os.lstat(path.parent)
    except OSError:
        return False
    return (stat.S_ISSOCK(found.st_mode) and found.st_uid == os.getuid() and folder.st_uid == os.getuid()
            and not folder.st_mode & 0o002)


def _connect(timeout: float = 2.0) -> socket.socket | None:
    path = socket_path()
    if not _trusted_socket(path):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout)
    try:
        connection.connect(str(path))
    except OSError:  # no server behind the socket (it died): run locally
        connection.close()
        return None
    if _peer_uid(connection) not in (None, os.getuid()):  # someone else listens there: never talk to it
        connection.close()
        return None
    connection.settimeout(None)
    return connection


def _listening() -> bool:
    """Whether a server of this home answers on its socket (the probe connects and leaves)."""
    probe = _connect()
    if probe is None:
        return False
    probe.close()
    return True


def _terminals() -> list[str]:
    """Which of this process's output streams are terminals ("out", "err")."""
    found = []
    for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
        with contextlib.suppress(AttributeError, ValueError):
            if stream.isatty():
                found.append(name)
    return found


def run_remotely(argv: list[str]) -> int | None:
    """Run a command line on the server; its exit code, or None when no server is running."""
    connection = _connect()
    if connection is None:
        return None
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    terminal = _terminals()
    if terminal and "COLUMNS" not in env:  # the server draws progress as wide as this terminal
        env["COLUMNS"] = str(shutil.get_terminal_size().columns)
    try:
        _send(connection, {"argv": argv, "cwd": os.getcwd(), "env": env, "terminal": terminal})
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
    except (OSError, ValueError):
        pass
    finally:
        connection.close()
    print("snapkv: error: the snapkv server stopped before the command ended; run it again (it runs here when no "
          "server answers)", file=sys.stderr)
    return 1


def stop_server() -> bool:
    """Ask the server to stop, and make sure it does: False when none is running."""
    connection = _connect()
    if connection is None:
        return False
    with connection:
        connection.settimeout(STOP_SECONDS)
        with contextlib.suppress(OSError):
            _send(connection, {"stop": True})
            connection.makefile("r").readline()
    path = socket_path()
    deadline = time.monotonic() + STOP_SECONDS
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if path.exists():  # no answer in time: the server holding the lock is signalled
        pid = _server_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
    return True


def disabled_by_environment() -> bool:
    """SNAPKV_NO_SERVER=1: every ask runs where it is typed, using no server and starting none."""
    return os.environ.get("SNAPKV_NO_SERVER", "") not in ("", "0")


def keep_alive_seconds() -> float:
    """How long the server the first `ask` starts waits for another request: SNAPKV_KEEP_ALIVE seconds
    (300 by default; 0 starts none)."""
    from snapkv.base.errors import ConfigError

    text = os.environ.get("SNAPKV_KEEP_ALIVE", "").strip()
    if not text:
        return KEEP_ALIVE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 7 * 86400:
        raise ConfigError(f"SNAPKV_KEEP_ALIVE={text!r}: give seconds from 0 (start no server) to 604800")
    return seconds


def start_in_background(idle_seconds: float, model: Optional[str], device: str, dtype: str) -> bool:
    """Start `snapkv serve` in a session of its own (its output to serve.log in the snapkv home) and wait until
    it listens: True then; False when it exited first (the caller runs the command itself, which reports what
    stopped the server, a missing model say). A server another command started meanwhile counts as started."""
    home = snapkv_home()
    home.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "snapkv_cli", "serve", "--idle-timeout", f"{idle_seconds:g}",
               "--device", device, "--dtype", dtype, *(["--model", model] if model else [])]
    with open(home / "serve.log", "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   start_new_session=True)  # Ctrl-C in this terminal does not reach it
    while not _listening():
        if process.poll() is not None:
            return _listening()  # exited because another server took the home: that one answers
        time.sleep(0.1)
    return True


def _server_pid() -> int | None:
    """The pid the running server wrote beside its lock (only a server of this home holds that lock)."""
    try:
        text = _lock_path().read_text().strip()
        return int(text) if text.isdigit() and written_only_by_me(_lock_path()) else None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- server

class ClientGone(Exception):
    """The client went away (Ctrl-C): the command stops at its next output."""


class BadRequest(ValueError):
    """A request the server does not take: answered with exit code 2, and the server goes on."""


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
                _send(self._connection, {self._kind: text})
        except OSError as error:  # gone, or not reading for SEND_SECONDS
            self.gone = True
            raise ClientGone() from error
        return len(text)

    def isatty(self) -> bool:
        return self._terminal

    @property
    def encoding(self) -> str:
        return "utf-8"


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


def _answer(connection: socket.socket, request: dict) -> None:
    """Run one `ask` with its output streamed to the client."""
    from .app import run

    argv = request["argv"]
    if argv[0] != "ask":  # the server runs `ask` only; anything else runs where it was typed
        _send(connection, {"err": "snapkv: error: the server runs `snapkv ask` only\n"})
        _send(connection, {"exit": 2})
        return
    connection.settimeout(SEND_SECONDS)
    lock, terminal = threading.Lock(), request.get("terminal", [])
    out, err = _Frames(connection, "out", lock, "out" in terminal), _Frames(connection, "err", lock, "err" in terminal)
    with _request_context(request), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run(argv)
        except ClientGone:
            code = 130
    if not out.gone and not err.gone:
        with contextlib.suppress(OSError):
            _send(connection, {"exit": code})


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
            if _peer_uid(connection) not in (None, os.getuid()):
                connection.close()
                return
            request = read_request(connection)
            if request is None:  # a probe (serve --status): connected and left
                connection.close()
            elif request.get("stop"):
                with contextlib.suppress(OSError):
                    _send(connection, {"exit": 0})
                connection.close()
                self.stopping.set()
                if self.busy.is_set():  # stop now, not after the answer in progress
                    os.kill(os.getpid(), signal.SIGTERM)
            else:
                self.requests.put((connection, request))
        except BadRequest as error:
            print(f"snapkv server: refused a request: {error}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                _send(connection, {"err": f"snapkv: error: bad request to the server: {error}\n"})
                _send(connection, {"exit": 2})
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
def _one_server_per_home():
    """The home's server lock, held for the server's life (with its pid for `serve --stop`); AlreadyServing
    when another server holds it."""
    import fcntl

    lock = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
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


def serve_forever(idle_seconds: float, preload: Optional[str], device: str, dtype: str) -> None:
    """Answer requests one at a time until idle for `idle_seconds` or asked to stop."""
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
                    _answer(connection, request)
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
    http: Optional[str] = typer.Option(None, "--http", metavar="[HOST:]PORT",
                                       help="Serve the OpenAI-compatible API (/v1/chat/completions, /v1/models, "
                                            "/health) on this port, 127.0.0.1 unless a host is given, instead of "
                                            "the local socket."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SNAPKV_API_KEY",
                                          help="With --http: answer only requests that send Authorization: Bearer "
                                               "KEY (required to listen beyond loopback)."),
    queue: int = typer.Option(8, "--queue", min=0, max=1024,
                              help="With --http: requests that may wait while one is answered; more get 429."),
    cite: bool = typer.Option(False, "--cite", help="With --http: list the passages each answer drew on "
                                                    "(snapkv.citations) unless a request says otherwise."),
    store: Optional[str] = typer.Option(None, "--store", metavar="URL", envvar="SNAPKV_STORE",
                                        help="With --http: the cache store, a folder or an fsspec URL shared by "
                                             "several servers (s3://bucket/prefix needs s3fs)."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="[ADDRESS]",
                                      help="With --http: run the API as a Ray Serve application, on a Ray started "
                                           "here (no ADDRESS) or on the cluster at ADDRESS (auto, ray://HOST:10001); "
                                           "needs pip install 'snapkv[cluster]'."),
    replicas: str = typer.Option("1", "--replicas", metavar="N|MIN-MAX",
                                 help="With --ray: replicas, each loading the model once; MIN-MAX autoscales."),
    replica_cpus: Optional[float] = typer.Option(None, "--replica-cpus", min=0.01,
                                                 help="With --ray: CPUs each replica reserves (default: this "
                                                      "machine's shared out on a Ray started here, else 1; GPU "
                                                      "replicas 1)."),
    truncate: TruncateOption = None,
) -> None:
    """Keep the model loaded so that `snapkv ask` answers without starting over (a local Unix socket), or, with
    --http, serve it to any OpenAI client, from this process or, with --ray, from replicas on Ray Serve.

    While it runs, `snapkv ask` runs there: same output, exit codes and --json; `ask --no-server` or
    SNAPKV_NO_SERVER=1 runs where it is typed instead. With --http, everything before a request's last user
    message is the document (its compressed cache looked up in the store, made and saved when missing) and that
    message is the question.
    """
    if store and http is None and "SNAPKV_STORE" not in os.environ:
        print("snapkv: error: --store goes with --http (SNAPKV_STORE sets the store of every command)",
              file=sys.stderr)
        raise typer.Exit(2)
    if cite and http is None:
        print("snapkv: error: --cite goes with --http (snapkv ask --cite cites through the local server)",
              file=sys.stderr)
        raise typer.Exit(2)
    if (ray is not None or replicas != "1" or replica_cpus is not None) and http is None:
        print("snapkv: error: --ray, --replicas and --replica-cpus go with --http (snapkv serve --http 8000 --ray)",
              file=sys.stderr)
        raise typer.Exit(2)
    if (replicas != "1" or replica_cpus is not None) and ray is None:
        print("snapkv: error: --replicas and --replica-cpus go with --ray", file=sys.stderr)
        raise typer.Exit(2)
    if http is not None:
        if stop or status or detach:
            print("snapkv: error: --http runs in the foreground; it takes none of --stop, --status, --detach",
                  file=sys.stderr)
            raise typer.Exit(2)
        if ray is not None:
            from .serve_ray import serve_ray

            serve_ray(ray, replicas, replica_cpus, http, api_key, queue, model, device, dtype, truncate, cite, store)
            return
        from .serve_http import serve_http

        serve_http(http, api_key, queue, model, device, dtype, truncate, cite, store)
        return
    path = socket_path()
    if stop:
        print("stopped the snapkv server" if stop_server() else "no snapkv server is running")
        return
    running = _listening()
    if status:
        print(f"a snapkv server is running on {path}" if running else "no snapkv server is running")
        if running:
            return
        raise typer.Exit(SERVER_STATE_EXIT)
    if running:
        print(f"a snapkv server is already running on {path}; stop it with snapkv serve --stop", file=sys.stderr)
        raise typer.Exit(SERVER_STATE_EXIT)
    if detach and not _detach():
        for _ in range(600):  # the parent waits until the server listens, so that the next ask finds it
            time.sleep(0.1)
            if _listening():
                print(f"snapkv server listening on {path} (idle timeout {idle_timeout:.0f} s); stop it with "
                      "snapkv serve --stop")
                return
        print("snapkv: error: the server did not start; see serve.log in the snapkv home", file=sys.stderr)
        raise typer.Exit(1)
    if not detach:
        print(f"snapkv server: loading the model, then listening on {path} (idle timeout {idle_timeout:.0f} s; "
              "Ctrl-C or snapkv serve --stop to end)", file=sys.stderr)
    try:
        with _one_server_per_home():
            serve_forever(idle_timeout, model, device, dtype)
    except AlreadyServing:
        print("snapkv: error: a snapkv server already runs for this home; stop it with snapkv serve --stop",
              file=sys.stderr)
        raise typer.Exit(SERVER_STATE_EXIT) from None
    except NotPrivate as error:
        print(f"snapkv: error: the server's socket folder cannot be trusted: {error}", file=sys.stderr)
        raise typer.Exit(1) from None
