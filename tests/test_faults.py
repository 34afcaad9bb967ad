"""Process faults: Ctrl-C, a full disk, an unwritable store, out of memory, and bugs. Nothing good is lost.

Ctrl-C is a KeyboardInterrupt raised inside the running code, exactly where Python delivers SIGINT.
Ctrl-C during an answer is in test_cli_commands.py; SIGKILL during a save and concurrent writers are in
test_store.py.
"""

import errno
from pathlib import Path

import pytest
import torch

import snapkv.storage.store as store_module
from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.base.errors import StorageError
from snapkv.session import Session
from snapkv.storage.cachefile import load_cache, save_cache

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"
DOCUMENT = Document(" ".join(f"Entry {i}: the harbour log notes calm water." for i in range(40)))


def store_files(home: Path) -> list[Path]:
    caches = home / "caches"
    return sorted(caches.rglob("*")) if caches.exists() else []


def interrupt_attention(monkeypatch, after_layer: int, error: BaseException) -> None:
    """Llama attention layers raise `error` in the first forward's layer `after_layer` (1-based), as Ctrl-C
    or a failed allocation would in the middle of a prefill; the later forwards run normally."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    real_forward, calls = LlamaAttention.forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == after_layer:
            raise error
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaAttention, "forward", forward)


# ------------------------------------------------------------------------------------ Ctrl-C

@pytest.mark.slow
def test_ctrl_c_during_prefill_saves_nothing(home, cli, monkeypatch):
    interrupt_attention(monkeypatch, 5, KeyboardInterrupt())
    result = cli("ask", SAMPLE, "What was the revenue?")
    assert result.code == 130 and "interrupted" in result.stderr and "Traceback" not in result.stderr
    assert store_files(home) == []


def _partial_then(error: BaseException):
    """safetensors' save_file that writes part of the file, then fails with `error`."""
    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"\x00" * 4096)
        raise error
    return save_file


@pytest.mark.parametrize("error, expected", [
    (KeyboardInterrupt(), KeyboardInterrupt),
    (OSError(errno.ENOSPC, "No space left on device"), StorageError),
])
def test_failed_save_keeps_the_old_file(tiny_loaded, tmp_path, monkeypatch, error, expected):
    session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8, query_aware=False))
    prepared = session.prepare(DOCUMENT)
    path = tmp_path / "doc.snapkv"
    session.save(prepared, path)
    before = path.read_bytes()
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _partial_then(error))
    with pytest.raises(expected) as raised:
        save_cache(path, prepared.cache)
    if expected is StorageError:
        assert "disk is full" in str(raised.value) and "earlier file there is intact" in str(raised.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "home") == ["doc.snapkv"]  # no temp, no lock
    load_cache(path)


# ------------------------------------------------------------------------------- disk and store

@pytest.mark.slow
def test_full_disk_during_compress_exits_7(home, cli, tmp_path, monkeypatch):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _partial_then(OSError(errno.ENOSPC, "No space left")))
    output = tmp_path / "out.snapkv"
    result = cli("compress", SAMPLE, "-o", output, "--budget", "256")
    assert result.code == 7 and "disk is full" in result.stderr and "Traceback" not in result.stderr
    assert not output.exists() and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_unwritable_store_still_answers(home, cli, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    monkeypatch.setattr(store_module, "snapkv_home", lambda: blocker)
    result = cli("ask", SAMPLE, "What was the revenue for the 2023 financial year?", "--budget", "256",
                 "--max-new-tokens", "12")
    assert result.code == 0, result.stderr
    assert "cannot save the cache" in result.stderr and "prefill again" in result.stderr
    assert result.stdout.strip()  # the answer was given anyway
    compressed = cli("compress", SAMPLE, "-o", blocker / "x.snapkv")
    assert compressed.code == 7 and "a file stands where a folder is needed" in compressed.stderr


# ---------------------------------------------------------------------------------- out of memory

@pytest.mark.slow
def test_preflight_refuses_what_cannot_fit(home, cli, monkeypatch):
    monkeypatch.setattr("snapkv.engine.memory.free_bytes", lambda device: 8 * 2**20)
    result = cli("ask", SAMPLE, "What was the revenue?")
    assert result.code == 6 and "Traceback" not in result.stderr
    assert "needs about" in result.stderr and "0.01 GiB is free" in result.stderr
    assert store_files(home) == []


@pytest.mark.slow
@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 9 GB")])
def test_real_out_of_memory_is_reported(home, cli, monkeypatch, error):
    interrupt_attention(monkeypatch, 3, error)
    result = cli("ask", SAMPLE, "What was the revenue?")
    assert result.code == 6 and "ran out of memory prefilling" in result.stderr
    assert "Traceback" not in result.stderr and store_files(home) == []


# ------------------------------------------------------------------------------------ bugs, --debug

def test_a_bug_is_an_internal_error_and_debug_shows_the_traceback(cli, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("snapkv.io.documents.read_sources", broken)
    plain = cli("ask", SAMPLE, "q")
    assert plain.code == 1 and "internal error: ZeroDivisionError: a bug" in plain.stderr
    assert "--debug" in plain.stderr and "Traceback" not in plain.stderr
    debug = cli("--debug", "ask", SAMPLE, "q")
    assert debug.code == 1 and "Traceback" in debug.stderr and "ZeroDivisionError" in debug.stderr


def test_exit_codes_are_documented(cli):
    from snapkv.base.errors import EXIT_CODES

    result = cli("--help")
    assert result.code == 0
    text = " ".join(result.stdout.split())
    for code, meaning in EXIT_CODES.items():
        assert f"{code} {meaning.split()[0]}" in text
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in readme
