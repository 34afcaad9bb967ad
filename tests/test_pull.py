"""snapkv pull against a local HTTP server (no other network): a GGUF kept under its name once its sha256 and header
check out, an interrupted pull resumed by a Range request, and files that fail a check deleted with a message."""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gguf_samples import gguf_bytes

from snapkv.base.paths import models_dir

FILE = gguf_bytes([("m.weight", (8, 4), 0, 0)], bytes(range(128)))


class Files(BaseHTTPRequestHandler):
    """Serves `files` (path -> bytes); honours `Range: bytes=N-` unless `ignore_range`; with `cut_once`, the first
    answer for a path stops half way through."""

    files: dict[str, bytes] = {}
    ranges: list[str] = []
    cut_once: set[str] = set()
    ignore_range = False

    def do_GET(self) -> None:
        content = self.files.get(self.path)
        if content is None:
            self.send_error(404)
            return
        start = 0
        asked = self.headers.get("Range")
        if asked:
            self.ranges.append(asked)
        if asked and not self.ignore_range:
            start = int(asked.removeprefix("bytes=").rstrip("-"))
            if start >= len(content):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        else:
            self.send_response(200)
        body = content[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path in self.cut_once:
            self.cut_once.discard(self.path)
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    Files.files = {"/tiny.gguf": FILE, "/page.gguf": b"<html>not a model</html>" * 10}
    Files.ranges, Files.cut_once, Files.ignore_range = [], set(), False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_pulled_file_is_kept_under_its_name_listed_and_found_by_name(server, cli):
    digest = hashlib.sha256(FILE).hexdigest()
    result = cli("pull", f"{server}/tiny.gguf", "--sha256", digest)
    assert result.code == 0, result.stderr
    kept = models_dir() / "tiny.gguf"
    assert kept.read_bytes() == FILE and "sha256 checked" in result.stderr and "snapkv ask -m tiny" in result.stdout
    assert not list(models_dir().glob(".*part"))
    listed = json.loads(cli("models", "--json").stdout)["models"]
    assert [entry["kind"] for entry in listed if entry["name"] == "tiny"] == ["gguf file"]
    from snapkv.engine.models import resolve_model_source

    assert resolve_model_source("tiny") == ("tiny", str(kept))
    again = cli("pull", f"{server}/tiny.gguf")
    assert again.code == 7 and "exists already" in again.stderr  # never overwritten


@pytest.mark.parametrize("ignore_range", [False, True])
def test_an_interrupted_pull_goes_on_where_it_stopped(server, cli, ignore_range):
    Files.cut_once = {"/tiny.gguf"}
    first = cli("pull", f"{server}/tiny.gguf", "--name", "resumed")
    assert first.code == 3 and "run the same command again" in first.stderr and "Traceback" not in first.stderr
    part = models_dir() / ".resumed.gguf.part"
    fetched = part.stat().st_size
    assert 0 < fetched < len(FILE) and not (models_dir() / "resumed.gguf").exists()
    Files.ignore_range = ignore_range  # a server without ranges sends it all again: started over, not appended
    second = cli("pull", f"{server}/tiny.gguf", "--name", "resumed", "--sha256", hashlib.sha256(FILE).hexdigest())
    assert second.code == 0, second.stderr
    assert Files.ranges == [f"bytes={fetched}-"]  # asked for the rest
    assert (models_dir() / "resumed.gguf").read_bytes() == FILE and not part.exists()


def test_a_file_that_fails_a_check_is_deleted_with_a_message(server, cli):
    wrong = cli("pull", f"{server}/tiny.gguf", "--sha256", "0" * 64)
    assert wrong.code == 3 and "sha256" in wrong.stderr and "not kept" in wrong.stderr
    page = cli("pull", f"{server}/page.gguf")
    assert page.code == 3 and "GGUF" in page.stderr
    missing = cli("pull", f"{server}/absent.gguf")
    assert missing.code == 3 and "404" in missing.stderr
    assert not models_dir().exists() or not any(models_dir().iterdir())


@pytest.mark.parametrize("arguments, message", [
    (("http://127.0.0.1:9/a.gguf", "--file", "b.gguf"), "--file goes with"),
    (("owner/name",), "--file NAME.gguf"),
    (("http://127.0.0.1:9/a.bin",), "GGUF files"),
    (("http://127.0.0.1:9/a.gguf", "--sha256", "xyz"), "64 hexadecimal"),
    (("http://127.0.0.1:9/a.gguf", "--name", "../up"), "cannot name"),
])
def test_what_cannot_be_pulled_is_a_usage_error(cli, arguments, message):
    result = cli("pull", *arguments)
    assert result.code == 2 and message in result.stderr and "Traceback" not in result.stderr
