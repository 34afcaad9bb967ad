"""The conventions of a command line people live in: fast help, --version, --debug anywhere, sizes, logs,
models, never downloading, a local server for instant follow-ups, and a REPL driven through a pty."""

import contextlib
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import start_server

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"
REVENUE = "What was the revenue for the 2023 financial year?"


def snapkv(*args, home: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "SNAPKV_HOME": str(home), "SNAPKV_NO_SERVER": "1", **(env or {})}
    environment.pop("SNAPKV_MODEL", None)
    return subprocess.run([sys.executable, "-m", "snapkv_cli", *map(str, args)], capture_output=True, text=True,
                          env=environment, timeout=timeout)


def test_help_does_not_import_torch_and_reads_at_80_columns(snapkv_home):
    probe = "import sys, snapkv_cli.app; print('torch' in sys.modules, 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split() == \
        ["False", "False"]
    result = snapkv("ask", "--help", home=snapkv_home, env={"COLUMNS": "80"})
    assert result.returncode == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    for shown in ("--store-method <reconstruction|snapkv|pseudo-question|key-norm>", "--store-bits BITS",
                  "--pooling <max|avg>", "--truncate <start|middle|end>", "--budget SIZE"):
        assert shown in result.stdout, shown


def test_version_and_debug_after_the_command(snapkv_home):
    from snapkv import __version__

    assert snapkv("--version", home=snapkv_home).stdout.strip() == f"snapkv {__version__}"
    missing = snapkv("info", "nothing.snapkv", "--debug", home=snapkv_home)
    assert missing.returncode == 5 and "Traceback" in missing.stderr and "no such cache file" in missing.stderr


def test_sizes_are_read_the_same_everywhere(snapkv_home):
    bad = snapkv("ask", SAMPLE, "q", "--budget", "lots", home=snapkv_home)
    assert bad.returncode == 2 and "--budget takes a number such as 7000, 8k or 1m" in bad.stderr
    from typer.testing import CliRunner

    from snapkv_cli.app import app

    for command in (["bench", "--lengths", "1kk"], ["eval", "needle", "--length", "1kk"]):
        with pytest.raises(Exception, match="--length takes a number"):
            CliRunner().invoke(app, command, catch_exceptions=False)


def test_a_model_not_on_disk_fails_fast_without_the_network(snapkv_home, tmp_path):
    started = time.perf_counter()
    result = snapkv("ask", SAMPLE, "q", "--model", "nosuch/model", home=snapkv_home,
                    env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"})
    assert result.returncode == 3 and "snapkv never downloads" in result.stderr
    assert "snapkv models" in result.stderr and "Traceback" not in result.stderr
    assert time.perf_counter() - started < 30  # no retries against a hub


def test_models_lists_what_is_on_disk(embedded_home, tmp_path):
    hub = tmp_path / "hf" / "hub" / "models--acme--tiny-llama"
    snapshot = hub / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("abc123")
    result = snapkv("models", "--json", home=embedded_home, env={"HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema_version"] == 1
    kinds = {entry["kind"]: entry for entry in data["models"]}
    assert kinds["embedded (default)"]["context"] == 8192 and kinds["embedded (default)"]["supported"]
    assert kinds["hugging face cache"]["name"] == "acme/tiny-llama" and kinds["hugging face cache"]["context"] == 4096


@pytest.mark.slow
def test_ask_logs_answers_and_finish_reasons(home, cli):
    result = cli("ask", SAMPLE, REVENUE, "Who chairs the board?", "--json", "--budget", "512",
                 "--max-new-tokens", "6")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema_version"] == 1
    assert [a["finish_reason"] for a in report["answers"]] == ["length", "length"]  # 6 tokens say less
    listed = cli("logs", "--json")
    entries = json.loads(listed.stdout)["entries"]
    assert [e["question"] for e in entries] == ["Who chairs the board?", REVENUE]  # newest first
    assert entries[0]["sources"] == [str(SAMPLE.resolve())] and entries[0]["finish_reason"] == "length"
    shown = cli("logs", "show", str(entries[1]["id"]))
    assert REVENUE in shown.stdout and "first token" in shown.stdout
    assert "Who chairs" in cli("logs").stdout
    quiet = cli("ask", SAMPLE, REVENUE, "--no-log", "--quiet", "--budget", "512", "--max-new-tokens", "30")
    assert "184.6" in quiet.stdout and "Q:" not in quiet.stderr and "first token" not in quiet.stderr
    assert len(json.loads(cli("logs", "--json", "-n", "50").stdout)["entries"]) == 2  # --no-log kept it out


@pytest.mark.slow
def test_a_source_is_recorded_by_its_absolute_path(home, cli, tmp_path, monkeypatch):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.txt").write_text("The vault code is 4417. " * 30)
    monkeypatch.chdir(folder)
    saved = tmp_path / "notes.snapkv"
    assert cli("compress", "notes.txt", "-o", saved, "--budget", "64").code == 0
    monkeypatch.chdir(tmp_path)  # elsewhere: the recorded path still finds the document
    (folder / "notes.txt").write_text("The vault code is 9999. " * 30)
    described = json.loads(cli("info", saved, "--json").stdout)
    assert described["sources"][0]["name"] == str(folder / "notes.txt")
    assert described["stale"] == [f"{folder / 'notes.txt'} has changed since this cache was made from it"]


@pytest.mark.slow
def test_the_server_answers_as_a_local_ask_does(home, tmp_path):
    """`snapkv serve` keeps the model loaded; `ask` runs there with the same stdout, exit codes and --json."""
    server, env = start_server(home)
    try:
        socket_file = home / "serve.sock"
        assert socket_file.exists() and oct(socket_file.stat().st_mode)[-3:] == "600"
        question = [SAMPLE, REVENUE, "--json", "--budget", "512", "--max-new-tokens", "24"]
        remote = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", *map(str, question)], env=env,
                                capture_output=True, text=True, timeout=600)
        assert remote.returncode == 0, remote.stderr
        local = snapkv("ask", *question, home=home)
        assert json.loads(remote.stdout)["answers"][0]["answer"] == json.loads(local.stdout)["answers"][0]["answer"]
        assert "184.6" in json.loads(remote.stdout)["answers"][0]["answer"]
        assert json.loads(remote.stdout)["timings"]["model_load_seconds"] < 0.5  # loaded once, by the server
        bad = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", str(SAMPLE), "q", "--budget", "16",
                              "--window", "32"], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "budget (16) must be larger" in bad.stderr
        stopped = subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--stop"], env=env,
                                 capture_output=True, text=True)
        assert stopped.stdout.strip() == "stopped the snapkv server"
        server.wait(timeout=30)
        assert not socket_file.exists()
    finally:
        server.kill()


@pytest.mark.timeout(900)
def test_the_first_ask_leaves_a_server_that_answers_the_next(home, tmp_path):
    """Without `serve`, the first ask starts a server in the background (said once on stderr) and runs there; the
    next ask as typed is a store hit on it, drawing progress as on the user's terminal; errors found before a model
    is needed, --no-server and SNAPKV_KEEP_ALIVE=0 start none."""
    env = {"SNAPKV_KEEP_ALIVE": "120", "SNAPKV_NO_SERVER": "0"}
    question = [SAMPLE, REVENUE, "--budget", "512", "--max-new-tokens", "24"]
    try:
        missing = snapkv("ask", tmp_path / "missing.txt", "Q", home=home, env=env)
        assert missing.returncode == 4 and "no such file" in missing.stderr
        assert snapkv("ask", "--no-server", *question, "-q", home=home, env=env).returncode == 0
        assert snapkv("ask", *question, "-q", home=home, env={**env, "SNAPKV_KEEP_ALIVE": "0"}).returncode == 0
        bad = snapkv("ask", *question, home=home, env={**env, "SNAPKV_KEEP_ALIVE": "soon"})
        assert bad.returncode == 2 and "SNAPKV_KEEP_ALIVE='soon'" in bad.stderr
        assert snapkv("serve", "--status", home=home).returncode == 8  # none of them started a server

        first = snapkv("ask", *question, home=home, env=env)
        assert first.returncode == 0, first.stderr
        assert first.stderr.count("started a server") == 1 and "stops after 2 min" in first.stderr
        assert "184.6" in first.stdout
        assert "\x1b[" not in first.stderr and "\r" not in first.stderr  # plain lines off a terminal
        assert snapkv("serve", "--status", home=home).returncode == 0

        second = snapkv("ask", *question, home=home, env=env)
        assert second.returncode == 0 and second.stdout == first.stdout
        assert "started a server" not in second.stderr and "loaded SmolLM2-135M-Instruct" in second.stderr
        assert "cache        hit" in second.stderr

        pid, fd = pty.fork()  # the same ask on a terminal: the server draws its spinner there
        if pid == 0:
            os.environ.update(SNAPKV_HOME=str(home), **env)
            os.execv(sys.executable, [sys.executable, "-m", "snapkv_cli", "ask", *map(str, question)])
        try:
            shown = _read_until(fd, "peak memory")
            assert "184.6" in shown and "\x1b[" in shown and "Thinking" in shown
            _, status = os.waitpid(pid, 0)
            assert os.WEXITSTATUS(status) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            os.close(fd)
    finally:
        assert snapkv("serve", "--stop", home=home).returncode == 0


def _read_until(fd: int, marker: str, timeout: float = 240) -> str:
    seen = ""
    deadline = time.time() + timeout
    while marker not in seen:
        if time.time() > deadline:
            raise AssertionError(f"{marker!r} never came; saw {seen[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], 1)
        if ready:
            try:
                seen += os.read(fd, 4096).decode(errors="replace")
            except OSError:
                break
    return seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_repl_in_a_terminal(home):
    """Through a pty, as a person types: tab completes a command, /set refuses nonsense kindly, answers stream."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: snapkv repl on a terminal
        os.environ.update(SNAPKV_HOME=str(home), COLUMNS="100", PROMPT_TOOLKIT_NO_CPR="1")
        os.execv(sys.executable, [sys.executable, "-m", "snapkv_cli", "repl", str(SAMPLE), "--budget", "512",
                                  "--max-new-tokens", "30"])
    try:
        _read_until(fd, "/help for commands.")
        _read_until(fd, "?")  # the prompt
        os.write(fd, b"/sh\t")
        _read_until(fd, "/show")  # completed by Tab
        time.sleep(0.5)
        os.write(fd, b"\r")
        shown = _read_until(fd, "max-tokens")
        assert "/show" in shown and "mode" in shown and "query-aware" in shown
        os.write(fd, b"/set temperature hot\r")
        assert "temperature takes a number, not 'hot'" in _read_until(fd, "not 'hot'")
        os.write(fd, (REVENUE + "\r").encode())
        assert "184.6" in _read_until(fd, "184.6")
        os.write(fd, b"/exit\r")
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.close(fd)
