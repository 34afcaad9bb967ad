"""The client side of the local server: `snapkv ask` runs on a server of its home when one answers, starts one in
the background when none does (snapkv_cli.ask), and `serve --stop` / `--status` find it. The protocol is
snapkv_cli.local_protocol's."""

import contextlib
import contextvars
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from snapkv.base.ownership import written_only_by_me
from snapkv.base.paths import snapkv_home

from .local_protocol import FORWARDED_ENV, lock_path, peer_uid, send, socket_path

KEEP_ALIVE_SECONDS = 300       # the server the first `ask` leaves stops after this long without a request
STOP_SECONDS = 10.0            # `serve --stop` waits this long for a reply, then signals the server itself
# The command line being run (set by snapkv_cli.app.run): what the first `ask` hands to the server it starts.
COMMAND_LINE: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("snapkv_command_line", default=None)


def trusted_socket(path: Path) -> bool:
    """The socket and its folder are this user's: a socket another user made must not receive our argv,
    folder and environment."""
    try:
        found, folder = os.lstat(path), os.lstat(path.parent)
    except OSError:
        return False
    return (stat.S_ISSOCK(found.st_mode) and found.st_uid == os.getuid() and folder.st_uid == os.getuid()
            and not folder.st_mode & 0o002)


def connect(timeout: float = 2.0) -> socket.socket | None:
    path = socket_path()
    if not trusted_socket(path):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout)
    try:
        connection.connect(str(path))
    except OSError:  # no server behind the socket (it died): run locally
        connection.close()
        return None
    if peer_uid(connection) not in (None, os.getuid()):  # someone else listens there: never talk to it
        connection.close()
        return None
    connection.settimeout(None)
    return connection


def listening() -> bool:
    """Whether a server of this home answers on its socket (the probe connects and leaves)."""
    probe = connect()
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
    connection = connect()
    if connection is None:
        return None
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    terminal = _terminals()
    if terminal and "COLUMNS" not in env:  # the server draws progress as wide as this terminal
        env["COLUMNS"] = str(shutil.get_terminal_size().columns)
    try:
        send(connection, {"argv": argv, "cwd": os.getcwd(), "env": env, "terminal": terminal})
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
    connection = connect()
    if connection is None:
        return False
    with connection:
        connection.settimeout(STOP_SECONDS)
        with contextlib.suppress(OSError):
            send(connection, {"stop": True})
            connection.makefile("r").readline()
    path = socket_path()
    deadline = time.monotonic() + STOP_SECONDS
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if path.exists():  # no answer in time: the server holding the lock is signalled
        pid = server_pid()
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
    while not listening():
        if process.poll() is not None:
            return listening()  # exited because another server took the home: that one answers
        time.sleep(0.1)
    return True


def server_pid() -> int | None:
    """The pid the running server wrote beside its lock (only a server of this home holds that lock)."""
    try:
        text = lock_path().read_text().strip()
        return int(text) if text.isdigit() and written_only_by_me(lock_path()) else None
    except OSError:
        return None
