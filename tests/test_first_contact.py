"""What a new user meets first: usage lines that read plainly, a folder's documents named (one form of each),
a neutral system message that is part of the cache key, plain progress lines off a terminal."""

import subprocess
import sys

import pytest

from snapkv.io.documents import read_sources
from snapkv.engine.prompting import DEFAULT_SYSTEM, Prompter


def snapkv(*args, home, env=None) -> subprocess.CompletedProcess:
    import os

    environment = {**os.environ, "SNAPKV_HOME": str(home), "SNAPKV_NO_SERVER": "1", "COLUMNS": "100", **(env or {})}
    return subprocess.run([sys.executable, "-m", "snapkv_cli", *map(str, args)], capture_output=True, text=True,
                          env=environment, timeout=600)


@pytest.mark.parametrize("argv, usage", [
    (["ask"], "Usage: snapkv ask [OPTIONS] SOURCE [QUESTION...]"),  # QUESTION may be left out with -c alone
    (["repl"], "Usage: snapkv repl [OPTIONS] SOURCE"),
    (["info"], "Usage: snapkv info [OPTIONS] FILE [DOCUMENT]"),
    (["cache", "rm"], "Usage: snapkv cache rm [OPTIONS] KEY..."),
])
def test_usage_lines_and_help_read_plainly(snapkv_home, argv, usage):
    shown = snapkv(*argv, "--help", home=snapkv_home).stdout
    assert shown.splitlines()[0] == usage
    assert "<str>" not in shown and "<list[str]>" not in shown and "<int>" not in shown and "{" not in shown
    if argv == ["ask"]:
        assert len(shown.splitlines()) < 110  # option help says what an option does; figures are in README
        assert "identical" not in shown and "ms/token" not in shown


def test_a_folder_reads_one_form_of_each_document_and_says_which(tmp_path):
    folder = tmp_path / "reports"
    (folder / "2023").mkdir(parents=True)
    (folder / "report.txt").write_text("Revenue was 184.6 million pounds.")
    (folder / "report.pdf").write_bytes(b"not read at all")  # a twin: never opened, so never refused
    (folder / "notes.md").write_text("The meeting is in Wick.")
    (folder / "2023" / "report.html").write_text("<p>Another folder, another document.</p>")
    document = read_sources(str(folder))
    names = [source.name for source in document.sources]
    assert names == [str((folder / name).resolve()) for name in ("2023/report.html", "notes.md", "report.txt")]
    assert document.notes == ["report.pdf was not read: report.txt is the same document in another form"]


def test_the_default_system_message_is_neutral_and_part_of_the_cache_key(embedded, tmp_path):
    from snapkv.compression.config import DEFAULTS
    from snapkv.io.documents import Document
    from snapkv.session import Session
    from snapkv.storage.store import cache_key

    tokenizer = embedded.tokenizer
    neutral, own, given = Prompter(tokenizer), Prompter(tokenizer, ""), Prompter(tokenizer, "Answer in French.")
    head = tokenizer.decode(neutral.head_ids)
    assert DEFAULT_SYSTEM in head and "SmolLM" not in head
    assert "SmolLM" in tokenizer.decode(own.head_ids)  # "" keeps the template's own
    assert "Answer in French." in tokenizer.decode(given.head_ids)
    assert neutral.tail_ids == own.tail_ids == given.tail_ids  # questions are the same for any system message
    document = Document("The chair of the board is Morag Sinclair.", [])
    keys = {cache_key(embedded.identity, Session(embedded, DEFAULTS, system=system).prompt(document).ids, None, 16)
            for system in (None, "", "Answer in French.")}
    assert len(keys) == 3


def test_progress_off_a_terminal_is_plain_lines(home, tmp_path):
    document = tmp_path / "note.txt"
    document.write_text("The chair of the board is Morag Sinclair. " * 20)
    result = snapkv("ask", document, "Who chairs the board?", "--max-new-tokens", "12", home=home)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    for stage in (f"snapkv: read {document}", "snapkv: loaded SmolLM2-135M-Instruct", "snapkv: prefilling",
                  "snapkv: prefilled"):
        assert any(line.startswith(stage) for line in lines), stage
    assert "\x1b[" not in result.stderr and "\r" not in result.stderr and "" not in lines
    assert "SmolLM" not in result.stdout
