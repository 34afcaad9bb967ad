"""Citations: the answer's attention over what the cache holds (against eager attention), the document's passages
with file, page and line, and cited answers through the library, the CLI and the HTTP API on the embedded model."""

import json

import pytest
import torch

from conftest import VOCAB, build_tiny
from pdf_fixtures import text_pdf
from snapkv.citing import Citation, Passage, Pooling, cite, passage_scores
from snapkv.citing.attention import answer_attention
from snapkv.citing.passages import MAX_PASSAGE_CHARS, document_passages
from snapkv.compression.config import DEFAULTS, SnapKVConfig
from snapkv.engine.generation import prefill
from snapkv.io.documents import read_sources
from snapkv.io.facts import sentence_spans
from snapkv.session import Session

SAMPLE = "samples/annual_report.txt"


# ------------------------------------------------------------------------------------------ the attention


@pytest.mark.parametrize("name, chunked", [("llama-gqa", False), ("llama-gqa", True), ("llama-mha", False),
                                           ("qwen3", False), ("phi3", False)])
def test_the_answer_rows_attention_equals_eager_attention_over_the_same_prompt(name, chunked, monkeypatch):
    if chunked:  # two rows scored at a time, as a long cache's rows are
        monkeypatch.setattr("snapkv.citing.attention.MAX_SCORED_VALUES", 2 * 4 * 48)
    model = build_tiny(name, attn_implementation="eager")
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (48,))  # a 36-token prompt, then 12 fed: the question and the answer
    cache = prefill(model, ids[:36], None)
    got = {}

    def keep(layer, summed, positions):  # (q_heads, held) each
        got[layer] = torch.zeros(summed.shape[0], 36).scatter_(1, positions, summed)

    answer_attention(model, cache, ids[36:], 5, keep)
    with torch.no_grad():
        attentions = model(ids.unsqueeze(0), output_attentions=True).attentions  # per layer (1, heads, 48, 48)
    assert sorted(got) == list(range(len(attentions)))
    for layer, weights in enumerate(attentions):
        expected = weights[0, :, 43:48, :36].sum(dim=1)  # the last 5 rows, over the prompt's positions
        torch.testing.assert_close(got[layer], expected, rtol=1e-4, atol=1e-5)


def test_a_cut_cache_gives_attention_to_the_positions_it_holds_only():
    model = build_tiny("llama-gqa")
    ids = torch.randint(3, VOCAB, (100,))
    cache = prefill(model, ids[:90], SnapKVConfig(budget=32, window=8).cut)
    seen = {}
    answer_attention(model, cache, ids[90:], 4, lambda layer, summed, positions: seen.update({layer: (summed, positions)}),
                     layers={1})
    assert list(seen) == [1]  # only the layers asked for
    summed, positions = seen[1]
    kv_positions = cache.positions[1]  # (kv_heads, 32)
    assert summed.shape == positions.shape == (4, 32)
    assert torch.equal(positions, kv_positions.repeat_interleave(2, dim=0))
    assert bool((summed >= 0).all()) and bool((summed.sum(dim=1) <= 4 + 1e-4).all())  # 4 rows' softmax, in part
    assert cache.keys[1].shape[1] == 32  # the cache is unchanged


# ------------------------------------------------------------------------------------------ the passages


def test_sentences_end_at_their_point_and_at_line_breaks_but_not_in_wrapped_prose():
    text = ("Net debt was 96.4\nmillion pounds at Northwind Ltd. in 2023. Results\nDear shareholders,\nwe grew in\n"
            "2023, a lot.\nRevenue 184.6\n121.3 Costs\n\nthe end")
    assert [text[a:b] for a, b in sentence_spans(text)] == [
        "Net debt was 96.4\nmillion pounds at Northwind Ltd. in 2023.", "Results",
        "Dear shareholders,\nwe grew in\n2023, a lot.", "Revenue 184.6", "121.3 Costs", "the end"]


def _passages(embedded, document, truncation=None):
    session = Session(embedded, None)
    prompt = session.prompt(document)
    return document_passages(embedded.tokenizer, prompt.ids, prompt.document_span, document.sources, truncation)


def test_a_text_files_passages_carry_its_lines_and_their_prompt_positions(embedded, tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("# Plant notes\n\nThe pump was\nserviced on 3 May. It runs at 40 bar.\n\n## Staff\nAda Lind "
                    "leads the crew.\n")
    document = read_sources(str(path))
    passages = _passages(embedded, document)
    assert [(p.text, p.line) for p in passages] == [
        ("# Plant notes", 1), ("The pump was serviced on 3 May.", 3), ("It runs at 40 bar.", 4), ("## Staff", 6),
        ("Ada Lind leads the crew.", 7)]
    assert {p.source for p in passages} == {str(path.resolve())} and all(p.page is None for p in passages)
    ids = Session(embedded, None).prompt(document).ids
    crew = passages[-1].positions
    assert embedded.tokenizer.decode(ids[crew.start:crew.stop]).strip() == "Ada Lind leads the crew."


def test_a_pdfs_passages_carry_their_page_and_line_and_never_run_over_a_page(embedded, tmp_path):
    path = tmp_path / "report.pdf"
    path.write_bytes(text_pdf([["Annual report 2023", "Revenue rose to 184.6 million pounds,"],
                               ["and net debt fell to 96.4 million.", "The chair is Eilidh MacLeod."]]))
    passages = _passages(embedded, read_sources(str(path)))
    where = [(p.text, p.page, p.line) for p in passages]
    assert ("Revenue rose to 184.6 million pounds,", 1, 2) in where
    assert ("and net debt fell to 96.4 million.", 2, 1) in where
    assert ("The chair is Eilidh MacLeod.", 2, 2) in where
    assert not any("[page" in text for text, _, _ in where)


def test_a_folders_passages_name_their_file(embedded, tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("Alpha one.\nAlpha two.\n")
    (folder / "sub" / "b.txt").write_text("Beta one.\n\nBeta three.\n")
    passages = _passages(embedded, read_sources(str(folder)))
    assert [(p.text, p.source.rsplit("/", 2)[-2:] if p.source else None, p.line) for p in passages] == [
        ("Alpha one.", ["docs", "a.txt"], 1), ("Alpha two.", ["docs", "a.txt"], 2),
        ("Beta one.", ["sub", "b.txt"], 1), ("Beta three.", ["sub", "b.txt"], 3)]


def test_a_folder_of_one_file_and_a_pdf_in_a_folder_name_their_files_pages_and_lines(embedded, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "only.txt").write_text("First line.\nSecond line.\n")
    passages = _passages(embedded, read_sources(str(alone)))
    assert [(p.text, p.line) for p in passages] == [("First line.", 1), ("Second line.", 2)]  # no header cited
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.md").write_text("## Results\n\nAlpha grew.\n")  # a heading of its own, not a file's header
    (mixed / "b.pdf").write_bytes(text_pdf([["Beta page one."], ["Beta page two."]]))
    where = [(p.text, p.source.rsplit("/", 1)[-1], p.page, p.line) for p in _passages(embedded, read_sources(str(mixed)))]
    assert where == [("## Results", "a.md", None, 1), ("Alpha grew.", "a.md", None, 3),
                     ("Beta page one.", "b.pdf", 1, 1), ("Beta page two.", "b.pdf", 2, 1)]


def test_a_sentence_without_an_end_is_cited_in_pieces(embedded, tmp_path):
    path = tmp_path / "table.csv"
    path.write_text(" ".join(f"cell{i}" for i in range(400)))
    passages = _passages(embedded, read_sources(str(path)))
    assert len(passages) > 3 and all(len(p.text) <= MAX_PASSAGE_CHARS for p in passages)
    assert " ".join(p.text for p in passages) == path.read_text()


@pytest.mark.parametrize("side", ["start", "middle", "end"])
def test_a_truncated_documents_lines_are_known_only_before_the_cut(embedded, tmp_path, side):
    path = tmp_path / "long.txt"
    path.write_text("".join(f"Line {i} says {i * 3}.\n" for i in range(1, 81)))
    document = read_sources(str(path))
    session = Session(embedded, None, truncate=side)
    prompt = session.prompt(document, max_tokens=session.prompter.overhead + 300)  # cut to 300 document tokens
    assert prompt.truncation is not None and prompt.truncation.side == side
    passages = document_passages(embedded.tokenizer, prompt.ids, prompt.document_span, document.sources,
                                 prompt.truncation)
    said = {p.text: p.line for p in passages}
    if side == "start":
        assert set(said.values()) == {None} and "Line 80 says 240." in said
    elif side == "end":
        assert said["Line 1 says 3."] == 1 and all(said[f"Line {i} says {i * 3}."] == i for i in range(1, 20))
    else:  # the lines before the middle cut are known; after it, not
        assert said["Line 1 says 3."] == 1 and said["Line 80 says 240."] is None


# ------------------------------------------------------------------------------------------ cited answers


@pytest.fixture(scope="module")
def sample_answers(embedded):
    """The sample report's cache and three answers with their citations (default settings, greedy)."""
    session = Session(embedded, DEFAULTS)
    prepared = session.prepare(read_sources(SAMPLE))
    answers = {}
    for question in ("What was the 2023 revenue?", "What is the net debt?", "What were the earnings per share?"):
        stream = session.ask(prepared, question, max_new_tokens=48)
        answers[question] = ("".join(stream), session.cite(prepared, stream), stream.result)
    return answers


@pytest.mark.parametrize("question, fact", [("What was the 2023 revenue?", "184.6"), ("What is the net debt?", "96.4"),
                                            ("What were the earnings per share?", "14.7")])
def test_the_top_citation_is_the_sentence_that_states_the_answers_fact(sample_answers, question, fact):
    text, citations, result = sample_answers[question]
    assert fact in text  # the model answers these right; the citation must point at where the fact is
    assert 1 <= len(citations) <= 3 and all(isinstance(c, Citation) for c in citations)
    top = citations[0]
    assert fact in top.text and top.source.endswith("annual_report.txt")
    with open(SAMPLE, encoding="utf-8") as file:
        assert " ".join(top.text.split(" ")[:4]) in file.read().splitlines()[top.line - 1]  # the line it starts on
    scores = [c.score for c in citations]
    assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1
    assert result.citations == citations and result.cite_seconds > 0


def test_an_empty_answer_cites_nothing(embedded):
    session = Session(embedded, DEFAULTS)
    prepared = session.prepare(read_sources(SAMPLE))
    cache = prepared.cache
    passages = document_passages(embedded.tokenizer, cache.token_ids, cache.document, prepared.document.sources)
    question = session.prompter.question_ids("What was the 2023 revenue?")
    assert cite(embedded.model, cache, question, torch.tensor([], dtype=torch.long), passages) == []
    assert cite(embedded.model, cache, question, torch.tensor([504, 28]), passages)  # two tokens of an answer do cite


def test_a_saved_cache_stays_in_its_stored_bits_when_it_cites(embedded, tmp_path):
    session = Session(embedded, DEFAULTS)
    path = tmp_path / "report.snapkv"
    session.save(session.prepare(read_sources(SAMPLE)), path)
    loaded = session.load_file(path)
    if not loaded.cache.deferred:
        pytest.skip("this machine loads the file restored (no deferred layers to keep stored)")
    stream = session.ask(loaded, "What was the 2023 revenue?", max_new_tokens=24)
    "".join(stream)
    assert session.cite(loaded, stream)
    assert all(layer is None for layer in loaded.cache.keys._restored + loaded.cache.values._restored)


def test_a_model_whose_chosen_depth_is_a_sliding_window_layer_reads_a_full_attention_one():
    model = build_tiny("gemma3")  # layers: sliding, full, sliding
    ids = torch.randint(3, VOCAB, (60,))
    cache = prefill(model, ids[:50], None)
    passages = [Passage(f"p{i}", range(i * 10, i * 10 + 10), None, None, None) for i in range(5)]
    for depth in (0.0, 0.6, 0.99):
        assert Pooling(depth=depth).layer([1], 3) == 1
        scores = passage_scores(model, cache, ids[50:56], ids[56:], passages, Pooling(depth=depth))
        assert float(scores.sum()) > 0 and bool((scores <= 1).all())


def test_ask_cite_prints_the_sources_and_json_has_each_answers_citations(cli, home):
    shown = cli("ask", "--no-server", "--cite", SAMPLE, "What was the 2023 revenue?")
    assert shown.code == 0, shown.stderr
    assert "Sources:" in shown.stdout and "annual_report.txt, line" in shown.stdout and "184.6" in shown.stdout
    assert "sources found in" in shown.stderr
    data = json.loads(cli("ask", "--no-server", "--cite", "--json", SAMPLE, "What was the 2023 revenue?").stdout)
    citation = data["answers"][0]["citations"][0]
    assert set(citation) == {"source", "page", "line", "text", "score"} and "184.6" in citation["text"]
    assert citation["source"].endswith("annual_report.txt") and citation["page"] is None and citation["line"] > 0
    plain = json.loads(cli("ask", "--no-server", "--json", SAMPLE, "What was the 2023 revenue?").stdout)
    assert "citations" not in plain["answers"][0]  # none asked for, none computed


def test_a_saved_cache_file_cites_its_recorded_source(cli, home, tmp_path):
    saved = tmp_path / "report.snapkv"
    assert cli("compress", SAMPLE, "-o", saved).code == 0
    data = json.loads(cli("ask", "--no-server", "--cite", "--json", saved, "What is the net debt?").stdout)
    citation = data["answers"][0]["citations"][0]
    assert "96.4" in citation["text"] and citation["source"].endswith("annual_report.txt")


def test_the_repl_cites_after_cite_on(cli, home, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("/cite on\n/show\nWhat was the 2023 revenue?\n/cite off\n"
                                                 "What is the net debt?\n"))
    shown = cli("repl", SAMPLE)
    assert shown.code == 0, shown.stderr
    assert "cite         on" in shown.stderr
    assert shown.stdout.count("Sources:") == 1 and "184.6" in shown.stdout.split("Sources:")[1]
