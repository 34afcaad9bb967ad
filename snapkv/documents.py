"""Read documents into text: text files, PDFs (pypdf), HTML, directories and stdin. No model here."""

import codecs
import hashlib
import html.parser
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DocumentError

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".csv", ".json", ".log", ".py", ".tex", ""}
HTML_SUFFIXES = {".html", ".htm"}
PDF_SUFFIXES = {".pdf"}
READABLE_SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES | PDF_SUFFIXES
MAX_FILE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class Source:
    """One input file as it was read: name, size, content digest and page count (PDFs)."""

    name: str
    size: int
    sha256: str
    pages: int | None = None


@dataclass
class Document:
    """The text handed to the model, and where it came from."""

    text: str
    sources: list[Source] = field(default_factory=list)


def decode_text(data: bytes, name: str) -> str:
    """UTF-8 (with or without BOM) or UTF-16 with BOM; anything else is refused by name."""
    if data.startswith(codecs.BOM_UTF16_LE) or data.startswith(codecs.BOM_UTF16_BE):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as error:
            raise DocumentError(f"{name}: starts with a UTF-16 mark but is not valid UTF-16 ({error})") from error
    if b"\x00" in data:
        raise DocumentError(f"{name}: contains NUL bytes, so it looks like a binary file, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DocumentError(
            f"{name}: is not valid UTF-8 (byte {error.start}); convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from error


class _VisibleText(html.parser.HTMLParser):
    """Collects the text a browser would show: no scripts, styles or tags."""

    HIDDEN = {"script", "style", "head", "template", "noscript"}
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "pre"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden_depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.HIDDEN:
            self.hidden_depth += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.HIDDEN and self.hidden_depth:
            self.hidden_depth -= 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.hidden_depth:
            self.parts.append(data)


def html_to_text(markup: str) -> str:
    parser = _VisibleText()
    parser.feed(markup)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def pdf_to_text(data: bytes, name: str, password: str | None = None) -> tuple[str, int]:
    """Text of every page, each headed by a page marker; (text, pages)."""
    import io

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            if reader.decrypt(password or "") == 0:
                hint = "the password is wrong" if password else "pass its password with --password"
                raise DocumentError(f"{name}: the PDF is encrypted and {hint}")
        pages = [page.extract_text() or "" for page in reader.pages]
    except DocumentError:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as error:
        raise DocumentError(f"{name}: not a readable PDF ({error})") from error
    if not any(page.strip() for page in pages):
        raise DocumentError(f"{name}: the PDF has no text layer (scanned pages?); run OCR on it first")
    text = "\n\n".join(f"[page {number}]\n{page.strip()}" for number, page in enumerate(pages, 1))
    return text, len(pages)


def read_bytes(data: bytes, name: str, suffix: str, password: str | None = None) -> tuple[str, Source]:
    digest = hashlib.sha256(data).hexdigest()
    pages = None
    if suffix in PDF_SUFFIXES:
        text, pages = pdf_to_text(data, name, password)
    elif suffix in HTML_SUFFIXES:
        text = html_to_text(decode_text(data, name))
    else:
        text = decode_text(data, name)
    if not text.strip():
        raise DocumentError(f"{name}: the document is empty")
    return text, Source(name=name, size=len(data), sha256=digest, pages=pages)


def read_file(path: Path, password: str | None = None) -> tuple[str, Source]:
    if not path.is_file():
        raise DocumentError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise DocumentError(f"{path}: {size / 2**20:.0f} MiB is more than the {MAX_FILE_BYTES // 2**20} MiB snapkv reads")
    return read_bytes(path.read_bytes(), str(path), path.suffix.lower(), password)


def read_sources(spec: str, password: str | None = None) -> Document:
    """A file, a directory (its readable files, recursively, in sorted order, each headed by its name), or '-' for stdin."""
    if spec == "-":
        text, source = read_bytes(sys.stdin.buffer.read(), "<stdin>", ".txt")
        return Document(text, [source])
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in READABLE_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DocumentError(f"{spec}: the folder holds no readable documents ({', '.join(sorted(s for s in READABLE_SUFFIXES if s))})")
        parts, sources = [], []
        for file in files:
            text, source = read_file(file, password)
            parts.append(f"## {file.relative_to(path)}\n\n{text.strip()}")
            sources.append(source)
        return Document("\n\n".join(parts), sources)
    if not path.exists():
        raise DocumentError(f"{spec}: no such file or folder")
    text, source = read_file(path, password)
    return Document(text, [source])
