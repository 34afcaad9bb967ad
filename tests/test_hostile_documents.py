"""Hostile and broken documents: each gets a clear message, exit code 4, no traceback, and never hangs.

Every fixture is built here (tests/pdf_fixtures.py); the PDF cases run through the real `snapkv ask`
entry point, which reads the document before it loads any model.
"""

import pytest

import pdf_fixtures as pdf
from snapkv.io.documents import MAX_FILE_BYTES, read_sources
from snapkv.base.errors import DocumentError

GOOD = pdf.text_pdf([["The 2023 revenue was 42 million."]])


def _cut_in_half() -> bytes:
    return GOOD[: len(GOOD) // 2]


def _without_startxref() -> bytes:
    return GOOD[: GOOD.rindex(b"startxref")] + b"%%EOF\n"


REFUSED_PDFS = {
    "empty file": (lambda: b"", None, "the file is empty"),
    "not a PDF": (lambda: b"hello, this is not a PDF at all", None, "not a readable PDF"),
    "cut in half": (_cut_in_half, None, "not a readable PDF"),
    "startxref missing": (_without_startxref, None, "not a readable PDF"),
    "user password, none given": (
        lambda: pdf.encrypted_pdf(["Secret 42."], user_password="open sesame", owner_password="o"), None,
        "pass its password with --password"),
    "user password, wrong one": (
        lambda: pdf.encrypted_pdf(["Secret 42."], user_password="open sesame", owner_password="o"), "guess",
        "the password given is wrong"),
    "RC4 user password, none given": (
        lambda: pdf.encrypted_pdf(["Secret 42."], user_password="pw", owner_password="o", algorithm="RC4-128"),
        None, "pass its password with --password"),
    "blank pages": (lambda: pdf.blank_pages_pdf(3), None, "run OCR"),
    "image-only page": (pdf.image_only_pdf, None, "run OCR"),
    "Flate stream inflating to 1 GiB": (pdf.flate_bomb_pdf, None, "decompression bomb"),
    "nested Flate": (lambda: pdf.flate_bomb_pdf(nested=True), None, "decompression bomb"),
    "cyclic page tree": (pdf.cyclic_page_tree_pdf, None, "not a readable PDF"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(REFUSED_PDFS))
def test_hostile_pdf_is_refused_clearly(case, tmp_path, cli):
    build, password, message = REFUSED_PDFS[case]
    path = tmp_path / "doc.pdf"
    path.write_bytes(build())
    args = ["ask", path, "What was the revenue?"] + (["--password", password] if password else [])
    result = cli(*args)
    assert result.code == 4, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("snapkv: error: ") and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [path]  # nothing written beside it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, build, password, expected", [
    ("right user password", lambda: pdf.encrypted_pdf(["Secret 42."], user_password="pw", owner_password="o"),
     "pw", "Secret 42."),
    ("owner password only", lambda: pdf.encrypted_pdf(["Open 42."], user_password="", owner_password="o"),
     None, "Open 42."),
    ("/Prev loop in the xref", pdf.prev_loop_pdf, None, "Looping xref."),
])
def test_pdf_that_should_open_opens(case, build, password, expected, tmp_path):
    path = tmp_path / "doc.pdf"
    path.write_bytes(build())
    assert expected in read_sources(str(path), password).text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hundred_thousand_blank_pages(tmp_path, monkeypatch):
    path = tmp_path / "blank.pdf"
    path.write_bytes(pdf.blank_pages_pdf(100_000))
    with pytest.raises(DocumentError, match="no text layer .*100000 in all"):
        read_sources(str(path))
    monkeypatch.setenv("SNAPKV_PDF_TIMEOUT", "1")  # the wall-clock limit stops the same work
    with pytest.raises(DocumentError, match="took longer than 1 s"):
        read_sources(str(path))


@pytest.mark.timeout(60)
def test_pdf_extraction_has_a_memory_limit(tmp_path, monkeypatch):
    """A 60 MiB stream (under pypdf's own bomb limit) breaks a 120 MiB budget that a small PDF fits in."""
    monkeypatch.setenv("SNAPKV_PDF_MEMORY_MB", "120")
    small, large = tmp_path / "small.pdf", tmp_path / "large.pdf"
    small.write_bytes(GOOD)
    large.write_bytes(pdf.flate_bomb_pdf(60 * 2**20))
    assert "42 million" in read_sources(str(small)).text
    with pytest.raises(DocumentError, match="needed more than 120 MiB"):
        read_sources(str(large))


# ------------------------------------------------------------------------------------------- text

@pytest.mark.parametrize("content, message", [
    (b"", "empty"),
    (b" \n\t \r\n  ", "empty"),
    ("Caf\u00e9 cr\u00e8me".encode("latin-1"), "not valid UTF-8"),
    (b"valid start \xff\xfe\xfd bytes", "not valid UTF-8"),
    (b"text\x00with\x00NULs", "binary file"),
])
def test_bad_text_is_refused(content, message, tmp_path, cli):
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    result = cli("ask", path, "q")
    assert result.code == 4 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_sparse_8_gib_file_is_refused_before_reading(tmp_path, cli, monkeypatch):
    path = tmp_path / "huge.txt"
    with open(path, "wb") as file:
        file.truncate(8 * 2**30)  # sparse: takes no disk space
    read_calls = []
    monkeypatch.setattr("pathlib.Path.read_bytes", lambda self: read_calls.append(self) or b"")
    result = cli("ask", path, "q")
    assert result.code == 4 and "8192 MiB" in result.stderr and f"{MAX_FILE_BYTES // 2**20} MiB" in result.stderr
    assert read_calls == []


def test_empty_folder_is_refused(tmp_path, cli):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "image.png").write_bytes(b"\x89PNG")
    result = cli("ask", tmp_path / "docs", "q")
    assert result.code == 4 and "holds no readable documents" in result.stderr


def test_unreadable_file_is_refused(tmp_path, cli, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("hidden")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr("pathlib.Path.read_bytes", denied)
    result = cli("ask", path, "q")
    assert result.code == 4 and "cannot read" in result.stderr and "Permission denied" in result.stderr
