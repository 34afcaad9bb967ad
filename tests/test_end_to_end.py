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
LONG_SAMPLE = Path(__file__).parent.parent / "samples" / "city_transport_review.txt"  # 6.6k tokens: the cut acts


@pytest.mark.slow
def test_readme_questions_keep_their_figures(home, cli):
    """README's first commands as a user types them, with the defaults, on a document long enough to be cut: the
    answers come out right, the second from the saved cache, each read from a quarter of the document's positions,
    and no answer states a number the document does not hold."""
    import json

    from snapkv.io.facts import numbers_of

    in_document = set(numbers_of(LONG_SAMPLE.read_text()))
    first = cli("ask", "--no-server", "-q", LONG_SAMPLE, "How many people did the authority employ at the end of the year?")
    second = cli("ask", "--no-server", "--json", LONG_SAMPLE,
                 "What is the reference of the ticketing back office replacement contract?")
    assert first.code == 0 and second.code == 0, first.stderr + second.stderr
    assert "4,318" in first.stdout, first.stdout
    report = json.loads(second.stdout)
    assert "TKT/24/0817" in report["answers"][0]["answer"], report["answers"][0]
    assert report["cache"]["hit"] and len(list((home / "caches").glob("*.snapkv"))) == 1  # the first one's cache
    compression = report["compression"]
    assert compression["mode"] == "query-aware" and compression["budget"] == 2048
    assert compression["kept_tokens"] == 2048 and report["document"]["tokens"] > 4 * 1600  # SnapKV acted
    for answer in (first.stdout, report["answers"][0]["answer"]):
        assert set(numbers_of(answer)) <= in_document, answer


@pytest.mark.slow
def test_the_default_cut_keeps_the_facts_of_a_long_document(embedded):
    """The default per-question cut over a 6.6k-token document reads 2048 positions per head and states the facts
    the full cache states, a figure, a date, a count and a code (those the full cache answers right in fp32 and bf16
    alike); a cut that drops the wrong positions, or a digit, fails here."""
    from snapkv.io.documents import read_sources

    questions = {"What was the tram punctuality for 2024, in per cent?": "91.3",
                 "On what date did the Kellington Line open to passengers?": "14 June 2024",
                 "How many people did the authority employ at the end of the year?": "4,318",
                 "What is the reference of the ticketing back office replacement contract?": "TKT/24/0817"}
    session = Session(embedded, SnapKVConfig())
    prepared = session.prepare(read_sources(str(LONG_SAMPLE)))
    assert prepared.kept_per_question == 2048 < prepared.tokens // 3
    for question, fact in questions.items():
        stream = session.ask(prepared, question, max_new_tokens=32)
        text = "".join(stream)
        assert fact in text, (question, text)
        assert stream.result.kv_bytes < prepared.cache.kv_bytes // 3  # decoded against the cut


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
    assert "184.6" in printed and "query-aware | whole prompt, 8-bit" in printed
    assert "annual_report.txt, line 11 Revenue for the 2023 financial year was 184.6" in printed  # its citation
    assert (tmp_path / "report.snapkv").is_file()
