"""The embedded model end to end: a needle found after compression, through the Session front door."""

from pathlib import Path

import pytest

from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.session import Session


@pytest.mark.slow
@pytest.mark.parametrize("depth, number", [(0.2, "37125"), (0.7, "80492")])
def test_needle_found_in_2k_tokens_with_budget_512_query_aware(embedded, depth, number):
    haystack = build_haystack(embedded.tokenizer, filler_text(), 2000, depth, number)
    session = Session(embedded, SnapKVConfig(budget=512, query_aware=True))
    prepared = session.prepare(Document(haystack.text))
    assert 1900 <= prepared.tokens <= 2400
    stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=10)
    text = "".join(stream)
    assert number in text, text
    assert stream.result.new_tokens >= 1


@pytest.mark.slow
def test_sample_report_answer(embedded):
    document = Document((Path(__file__).parent.parent / "samples" / "annual_report.txt").read_text())
    session = Session(embedded, SnapKVConfig(budget=512))
    prepared = session.prepare(document)
    text = "".join(session.ask(prepared, "What was the revenue for the 2023 financial year?", max_new_tokens=30))
    assert "184.6" in text, text


SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"


@pytest.mark.slow
def test_readme_questions_keep_their_figures(home, cli):
    """README's first commands as a user types them, with the defaults: the revenue and the net debt come out
    right, the second from the saved cache, and no answer states a number the report does not hold."""
    from snapkv.io.facts import numbers_of

    in_document = set(numbers_of(SAMPLE.read_text()))
    first = cli("ask", "--no-server", "-q", SAMPLE, "What was the 2023 revenue?")
    second = cli("ask", "--no-server", "-q", SAMPLE, "What is the net debt?")
    assert first.code == 0 and second.code == 0, first.stderr + second.stderr
    assert "184.6" in first.stdout, first.stdout
    assert "96.4" in second.stdout, second.stdout
    for answer in (first.stdout, second.stdout):
        assert set(numbers_of(answer)) <= in_document, answer
    assert len(list((home / "caches").glob("*.snapkv"))) == 1  # the second question read the first one's cache


@pytest.mark.slow
def test_readme_library_example_runs(embedded_home, tmp_path, monkeypatch, capsys):
    """The README's library example, run as written (from a folder where samples/ is found)."""
    import re

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    [code] = re.findall(r"## Library\n\n```python\n(.*?)```", readme, flags=re.S)
    monkeypatch.setenv("SNAPKV_HOME", str(embedded_home))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "samples").symlink_to(Path(__file__).parent.parent / "samples")
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "184.6" in printed and "query-aware | whole prompt, 16/8-bit" in printed
    assert "annual_report.txt, line 11 Revenue for the 2023 financial year was 184.6" in printed  # its citation
    assert (tmp_path / "report.snapkv").is_file()
