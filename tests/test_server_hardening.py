"""A hostile socket, a planted library and folders another could write: the server never dies or stalls on
one client, nothing of the user's is sent to a listener snapkv did not start, no library runs that snapkv did
not build."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import start_server
from snapkv import native
from snapkv.base.ownership import NotPrivate, private_folder, written_only_by_me
from snapkv_cli import local_client, local_protocol, local_server

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"


# ------------------------------------------------------------------------------------------- requests

@pytest.mark.parametrize("request_, message", [
    ([], "JSON object"),
    (5, "JSON object"),
    ({"argv": ["ask"], "cwd": "/", "env": {"SNAPKV_MODEL": 3}}, "env"),
    ({"argv": "ask", "cwd": "/"}, "argv"),
    ({"argv": ["ask", 7], "cwd": "/"}, "argv"),
    ({"argv": ["ask"], "cwd": "relative"}, "cwd"),
    ({"argv": ["ask"], "cwd": ["/"]}, "cwd"),
    ({"argv": ["ask"], "cwd": "/", "extra": 1}, "unknown"),
    ({"stop": 1}, "unknown request keys"),
    ({"argv": ["ask"], "cwd": "/", "terminal": ["tty"]}, "terminal"),
    ({"argv": ["ask"], "cwd": "/", "terminal": [["out"]]}, "terminal"),
    ({"argv": ["ask"], "cwd": "/", "terminal": "out"}, "terminal"),
])
def test_requests_of_the_wrong_shape_are_refused(request_, message):
    with pytest.raises(local_protocol.BadRequest, match=message):
        local_protocol.validated(request_)
    assert local_protocol.validated({"stop": True}) == {"stop": True}
    assert local_protocol.validated({"argv": ["ask", "a"], "cwd": "/", "env": {"COLUMNS": "80"}})["argv"] == ["ask", "a"]


def test_a_request_is_bounded_in_time_and_length(monkeypatch):
    monkeypatch.setattr(local_protocol, "REQUEST_SECONDS", 0.3)
    silent, server_side = socket.socketpair()
    started = time.monotonic()
    with pytest.raises(local_protocol.BadRequest, match="no request within"):
        local_protocol.read_request(server_side)
    assert time.monotonic() - started < 3
    monkeypatch.setattr(local_protocol, "MAX_REQUEST_BYTES", 100_000)
    endless, server_side = socket.socketpair()
    def flood():
        with contextlib.suppress(OSError):  # the server side stops reading and closes
            endless.sendall(b"x" * 300_000)

    threading.Thread(target=flood, daemon=True).start()
    with pytest.raises(local_protocol.BadRequest, match="longer than"):
        local_protocol.read_request(server_side)
    client, server_side = socket.socketpair()
    client.sendall(b"[1, 2]\n")
    with pytest.raises(local_protocol.BadRequest, match="JSON object"):
        local_protocol.read_request(server_side)
    client, server_side = socket.socketpair()
    client.close()
    assert local_protocol.read_request(server_side) is None  # a probe that connected and left


def test_a_silent_client_holds_up_no_one(monkeypatch, tmp_path):
    monkeypatch.setattr(local_protocol, "REQUEST_SECONDS", 5)
    receiver = local_server._Receiver()
    silent, silent_server = socket.socketpair()
    receiver.take(silent_server)
    client, client_server = socket.socketpair()
    receiver.take(client_server)
    client.sendall((json.dumps({"argv": ["ask", "x"], "cwd": str(tmp_path)}) + "\n").encode())
    connection, request = receiver.requests.get(timeout=2)  # well before the silent one times out
    assert request["argv"] == ["ask", "x"]
    bad, bad_server = socket.socketpair()
    receiver.take(bad_server)
    bad.sendall(b"{\"argv\": [\"ask\"], \"cwd\": \"/\", \"env\": {\"COLUMNS\": 80}}\n")
    replies = [json.loads(line) for line in bad.makefile().read().splitlines()]
    assert replies[-1] == {"exit": 2} and "bad request" in replies[0]["err"]


def test_only_the_server_that_made_the_socket_removes_it(tmp_path):
    path = tmp_path / "serve.sock"
    first = socket.socket(socket.AF_UNIX)
    first.bind(str(path))
    made = os.lstat(path)
    path.unlink()
    second = socket.socket(socket.AF_UNIX)
    second.bind(str(path))  # a later server's socket at the same path
    local_server._remove_own_socket(path, made)
    assert path.exists()
    local_server._remove_own_socket(path, os.lstat(path))
    assert not path.exists()


# ------------------------------------------------------------------------------------------- ownership

def test_private_folders_and_files_written_only_by_this_user(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    assert private_folder(folder) == folder and oct(folder.stat().st_mode)[-3:] == "700"
    assert oct(private_folder(tmp_path / "new" / "deeper").stat().st_mode)[-3:] == "700"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotPrivate, match="not a folder"):
        private_folder(tmp_path / "link")
    library = folder / "kernels.so"
    library.write_bytes(b"x")
    os.chmod(library, 0o755)
    assert written_only_by_me(library)
    os.chmod(library, 0o666)
    assert not written_only_by_me(library)
    (folder / "linked.so").symlink_to(library)
    assert not written_only_by_me(folder / "linked.so")


def test_a_socket_in_a_folder_others_can_write_is_never_used(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "serve.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    monkeypatch.setattr(local_client, "socket_path", lambda: path)
    assert local_client.trusted_socket(path)
    connection = local_client.connect()
    assert connection is not None
    connection.close()
    os.chmod(folder, 0o777)  # anyone could have put a socket here
    assert local_client.connect() is None


def test_a_planted_library_is_rebuilt_never_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_HOME", str(tmp_path))
    if native.unavailable_reason() is not None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    sources = {"k.c": b"int answer(void) { return 42; }\n"}
    built = Path(native._build(sources, native._compiler()))
    assert oct(built.parent.stat().st_mode)[-3:] == "700" and written_only_by_me(built)
    # a library others could have written: replaced by a fresh build, not used
    built.write_bytes(b"planted")
    os.chmod(built, 0o666)
    again = Path(native._build(sources, native._compiler()))
    assert again == built and written_only_by_me(again) and again.read_bytes() != b"planted"
    # a build killed half-way leaves its scratch folder: removed by the next build once it is old
    abandoned = built.parent / f"{native.SCRATCH_PREFIX}killed"
    abandoned.mkdir()
    old = time.time() - native.ABANDONED_SECONDS - 5
    os.utime(abandoned, (old, old))
    built.unlink()
    native._build(sources, native._compiler())
    assert not abandoned.exists()


# ------------------------------------------------------------------------------------------- a real server

def _cli(*args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "snapkv_cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_server_survives_bad_clients_and_always_stops(home):
    server, env = start_server(home, idle_seconds=300)
    try:
        path = home / "serve.sock"
        # a second server for the same home is refused, and leaves the first's socket alone
        second = _cli("serve", "--idle-timeout", "5", env=env, timeout=300)
        assert second.returncode == 8 and "already" in second.stderr and path.exists()
        # a silent client, a non-object request and a non-text env value: answered or dropped, never fatal
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(str(path))
        for bad in (b"[]\n", b"{\"argv\": [\"ask\", \"q\"], \"cwd\": \"/\", \"env\": {\"COLUMNS\": 5}}\n"):
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(path))
            client.sendall(bad)
            assert json.loads(client.makefile().read().splitlines()[-1]) == {"exit": 2}
            client.close()
        answer = _cli("ask", SAMPLE, "What was the 2023 revenue?", "--max-new-tokens", "20", "-q", env=env, timeout=300)
        assert answer.returncode == 0 and "184.6" in answer.stdout, answer.stderr
        # help asked of the server itself (click writes it as bytes where the stream is not a terminal), and `ask -h`
        # with stdin not a terminal, which stays here as --help does
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(path))
        client.sendall(json.dumps({"argv": ["ask", "-h"], "cwd": "/", "env": {}, "terminal": []}).encode() + b"\n")
        messages = [json.loads(line) for line in client.makefile().read().splitlines()]
        client.close()
        assert messages[-1] == {"exit": 0} and "Usage" in "".join(m.get("out", "") for m in messages)
        shown = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", "-h"], env=env, input="", text=True,
                               capture_output=True, timeout=120)
        assert shown.returncode == 0 and "Usage" in shown.stdout and not shown.stderr, shown.stderr
        # a stop while an answer runs: it stops now, not after the answer
        long_document = home.parent / "long.txt"  # a prefill of many seconds
        long_document.write_text(" ".join(f"Entry {i} records {i * 7} units." for i in range(500)))
        busy = subprocess.Popen([sys.executable, "-m", "snapkv_cli", "ask", str(long_document), "Which entry?"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(4)
        assert busy.poll() is None  # still prefilling on the server
        started = time.monotonic()
        stopped = _cli("serve", "--stop", env=env, timeout=60)
        assert stopped.stdout.strip() == "stopped the snapkv server"
        server.wait(timeout=30)
        assert time.monotonic() - started < 30 and busy.wait(timeout=30) != 0
        assert not path.exists()
        silent.close()
    finally:
        server.kill()


def test_one_server_per_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_HOME", str(tmp_path))
    with local_server.one_server_per_home():
        assert local_client.server_pid() == os.getpid()
        with pytest.raises(local_server.AlreadyServing):
            with local_server.one_server_per_home():
                pass
    with local_server.one_server_per_home():  # released when the first ends
        pass
