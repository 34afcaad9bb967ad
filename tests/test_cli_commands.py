"""compress, info, cache and repl, driven in-process with CliRunner, on the embedded model."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import snapkv.session as session_module
from snapkv_cli.app import app
from snapkv_cli.common import inert

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"
REVENUE = "What was the revenue for the 2023 financial year?"


def invoke(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


def test_inert_text():
    assert inert("a\x1b[31mred\x1b[0m [bold]b[/bold]\x07\n\tc") == "a[31mred[0m [bold]b[/bold]\n\tc"


@pytest.mark.slow
def test_compress_info_and_cache_commands(home, tmp_path):
    output = tmp_path / "report.snapkv"
    result = invoke("compress", str(SAMPLE), "--output", str(output), "--budget", "256")
    assert result.exit_code == 0, result.output
    assert "kept per KV head per layer" in result.stderr and output.is_file()
    described = json.loads(invoke("info", str(output), "--json").stdout)
    assert described["mode"] == "document-window" and max(described["kept_per_layer"]) == 256
    assert described["sources"][0]["name"] == str(SAMPLE)
    human = invoke("info", str(output))
    assert "SmolLM2-135M-Instruct" in human.stdout and "document-window" in human.stdout
    # a query-aware tier saved by compress answers questions without the document
    tier = tmp_path / "tier.snapkv"
    assert invoke("compress", str(SAMPLE), "--output", str(tier), "--query-aware").exit_code == 0
    answered = invoke("ask", str(tier), REVENUE, "--json", "--budget", "256")
    assert "184.6" in json.loads(answered.stdout)["answers"][0]["answer"]
    # the store: one entry from an ask, listed, removed; clear
    invoke("ask", str(SAMPLE), REVENUE, "--json", "--budget", "256")
    entries = json.loads(invoke("cache", "list", "--json").stdout)
    assert len(entries) == 1 and entries[0]["bytes"] > 0
    assert "1 caches" in invoke("cache", "list").stdout
    assert invoke("cache", "rm", entries[0]["key"][:10]).exit_code == 0
    assert json.loads(invoke("cache", "list", "--json").stdout) == []
    invoke("ask", str(SAMPLE), REVENUE, "--json", "--budget", "256")
    assert "removed 1" in invoke("cache", "clear", "--yes").stdout


def test_compress_refuses_to_overwrite_a_foreign_file(home, tmp_path):
    precious = tmp_path / "notes.snapkv"
    precious.write_text("my notes")
    with pytest.raises(Exception, match="refusing to overwrite"):
        invoke("compress", str(SAMPLE), "--output", str(precious))
    assert precious.read_text() == "my notes"


@pytest.mark.slow
def test_repl_through_stdin(home, tmp_path):
    saved = tmp_path / "from-repl.snapkv"
    script = "\n".join([REVENUE, "/budget 512", "/query-aware off", "/stats", "Where will the next annual \\",
                        "general meeting be held?", f"/save {saved}", "/nonsense", "/exit", "never asked"]) + "\n"
    result = invoke("repl", str(SAMPLE), input=script)
    assert result.exit_code == 0, result.output
    assert "184.6" in result.stdout and "Wick" in result.stdout
    assert "budget 512" in result.stderr and "query-aware off" in result.stderr
    assert "unknown command /nonsense" in result.stderr
    assert saved.is_file()
    assert "never asked" not in result.stdout


@pytest.mark.slow
def test_ctrl_c_mid_answer_keeps_the_cache_and_the_session(home, monkeypatch):
    real_answer, real_prepare = session_module.answer, session_module.Session.prepare
    calls, prepared_seen = [], []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        for count, token in enumerate(real_answer(*args, **kwargs)):
            if len(calls) == 1 and count == 3:
                raise KeyboardInterrupt
            yield token

    def capture(self, document):
        prepared = real_prepare(self, document)
        cache = prepared.cache
        prepared_seen.append((prepared, [t.clone() for t in cache.keys + cache.values + cache.positions]))
        return prepared

    monkeypatch.setattr(session_module, "answer", interrupted_once)
    monkeypatch.setattr(session_module.Session, "prepare", capture)
    result = invoke("repl", str(SAMPLE), input=f"{REVENUE}\n{REVENUE}\n")
    assert result.exit_code == 0, result.output
    assert "answer stopped" in result.stderr
    assert "184.6" in result.stdout  # the second, uninterrupted answer
    prepared, snapshot = prepared_seen[0]
    after = prepared.cache.keys + prepared.cache.values + prepared.cache.positions
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot))


@pytest.mark.slow
def test_ask_shows_markup_and_escapes_inert(home):
    question = "What was the revenue? \x1b[2J[bold red]loud[/bold red]"
    result = invoke("ask", str(SAMPLE), question, "--budget", "256", "--max-new-tokens", "5")
    assert result.exit_code == 0
    assert "[bold red]loud[/bold red]" in result.stderr and "\x1b[2J" not in result.stderr


def test_document_longer_than_the_context_is_refused_or_cut(home, tmp_path):
    long_document = tmp_path / "long.txt"
    long_document.write_text(SAMPLE.read_text() * 10)
    with pytest.raises(Exception, match=r"holds 8192 tokens.*--truncate"):
        invoke("ask", str(long_document), "q", "--no-store")
