"""The embedded model end to end: a needle found after compression, through the Session front door."""

from pathlib import Path

import pytest

from snapkv.config import SnapKVConfig
from snapkv.documents import Document
from snapkv.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
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
    assert "184.6" in printed and "query-aware | whole prompt, 3/2-bit, 20% at 8/4-bit" in printed
    assert (tmp_path / "report.snapkv").is_file()
