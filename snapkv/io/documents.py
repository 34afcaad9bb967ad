"""Read documents into text: text files, PDFs (pypdf), HTML, directories and stdin. No model here."""

import codecs
import hashlib
import html.parser
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from snapkv.base.errors import DocumentError

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
    notes: list[str] = field(default_factory=list)  # what the user should hear about (a twin file left out)


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


PDF_TIMEOUT_SECONDS = 120        # wall clock for one PDF; SNAPKV_PDF_TIMEOUT overrides
PDF_MEMORY_MIB = 2048            # address space of the extraction process; SNAPKV_PDF_MEMORY_MB overrides


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = float(value)
    except ValueError as error:
        raise DocumentError(f"{name}={value!r} is not a number") from error
    if number <= 0:
        raise DocumentError(f"{name} must be positive, not {value!r}")
    return number


def _pdf_failure(name: str, kind: str, detail: str, memory_mib: float) -> DocumentError:
    messages = {
        "password": "the PDF is encrypted; pass its password with --password",
        "wrong_password": "the PDF is encrypted and the password given is wrong",
        "limit": f"a compressed stream in the PDF inflates past the reader's safety limit, as a decompression "
                 f"bomb does ({detail}); the file is refused",
        "loop": f"the PDF's structure loops back on itself ({detail}); it is malformed",
        "memory": f"reading the PDF needed more than {memory_mib:.0f} MiB (SNAPKV_PDF_MEMORY_MB); it is "
                  "malformed or hostile, or raise the limit if you trust it",
        "dependency": f"the PDF needs an optional library to decrypt it ({detail})",
    }
    return DocumentError(f"{name}: " + messages.get(kind, f"not a readable PDF ({detail})"))


def pdf_to_text(data: bytes, name: str, password: str | None = None) -> tuple[str, int]:
    """Text of every page, each headed by a page marker; (text, pages).

    pypdf runs in a child process (snapkv.io.pdf_worker) under a memory limit and a wall-clock limit, so a
    hostile PDF cannot hang or exhaust snapkv itself.
    """
    if not data.strip():
        raise DocumentError(f"{name}: the file is empty")
    timeout = _env_number("SNAPKV_PDF_TIMEOUT", PDF_TIMEOUT_SECONDS)
    memory_mib = _env_number("SNAPKV_PDF_MEMORY_MB", PDF_MEMORY_MIB)
    request = {"password": password, "memory_bytes": int(memory_mib * 2**20), "cpu_seconds": int(timeout) + 1}
    try:
        finished = subprocess.run(
            [sys.executable, "-m", "snapkv.io.pdf_worker"], input=json.dumps(request).encode() + b"\n" + data,
            capture_output=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        finished = None
    if finished is None or finished.returncode == -signal.SIGXCPU:
        raise DocumentError(
            f"{name}: reading the PDF took longer than {timeout:.0f} s and was stopped; it may be malformed. "
            "If it is simply very large, allow more time with SNAPKV_PDF_TIMEOUT=<seconds>."
        )
    try:
        result = json.loads(finished.stdout)
    except json.JSONDecodeError:
        if finished.returncode < 0 or b"MemoryError" in finished.stderr:  # killed by a limit
            raise _pdf_failure(name, "memory", "", memory_mib) from None
        raise DocumentError(f"{name}: the PDF reader failed (exit code {finished.returncode}); "
                            "the file is probably malformed") from None
    if not result.get("ok"):
        raise _pdf_failure(name, result.get("kind", ""), result.get("detail", ""), memory_mib)
    pages = result["pages"]
    if not any(page.strip() for page in pages):
        raise DocumentError(f"{name}: the PDF has no text layer (blank or scanned pages, {len(pages)} in all); "
                            "run OCR on it first, e.g. ocrmypdf in.pdf out.pdf")
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
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DocumentError(f"{path}: cannot read ({error.strerror or error})") from error
    text, source = read_bytes(data, str(path), path.suffix.lower(), password)
    # recorded by its absolute path, so that whether a cache is stale does not depend on the current folder
    return text, replace(source, name=str(path.resolve()))


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
        files, notes = _without_twins(files, path)
        parts, sources = [], []
        for file in files:
            text, source = read_file(file, password)
            parts.append(f"## {file.relative_to(path)}\n\n{text.strip()}")
            sources.append(source)
        return Document("\n\n".join(parts), sources, notes)
    if not path.exists():
        raise DocumentError(f"{spec}: no such file or folder")
    text, source = read_file(path, password)
    return Document(text, [source])


# Where a folder holds one document in several forms (report.txt and report.pdf), the first form here is read:
# text as written before text recovered from markup, and that before text extracted from a PDF.
FORM_PREFERENCE = [".md", ".markdown", ".txt", ".rst", ".tex", ".html", ".htm", ".pdf"]


def _without_twins(files: list[Path], folder: Path) -> tuple[list[Path], list[str]]:
    """One file per document name (folder and stem) among the forms in FORM_PREFERENCE, in the files' order; a note
    for each file left out, naming the one read instead."""
    def rank(file: Path) -> int:
        return FORM_PREFERENCE.index(file.suffix.lower())

    chosen: dict[Path, Path] = {}
    for file in files:
        if file.suffix.lower() not in FORM_PREFERENCE:
            continue
        stem = file.with_suffix("")
        if stem not in chosen or rank(file) < rank(chosen[stem]):
            chosen[stem] = file
    kept = [f for f in files if f.suffix.lower() not in FORM_PREFERENCE or chosen[f.with_suffix("")] == f]
    notes = [f"{file.relative_to(folder)} was not read: {chosen[file.with_suffix('')].relative_to(folder)} is the same "
             "document in another form" for file in files if file not in kept]
    return kept, notes


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def stale_sources(recorded: list[Source], given: Document | None = None) -> list[str]:
    """Why a saved cache no longer matches its documents; [] when nothing is known to have changed.

    given: the document(s) the user says the cache was made from. Without it, each recorded source that
    still exists at the path it was read from is checked.
    """
    if given is not None:
        known = {source.sha256 for source in recorded}
        changed = [source.name for source in given.sources if source.sha256 not in known]
        if changed or len(given.sources) != len(recorded):
            names = ", ".join(changed) or "the documents given"
            return [f"{names} differ from what this cache was made from "
                    f"({', '.join(s.name for s in recorded) or 'unknown sources'})"]
        return []
    reasons = []
    for source in recorded:
        path = Path(source.name)
        try:
            if path.is_file() and (path.stat().st_size != source.size or file_sha256(path) != source.sha256):
                reasons.append(f"{source.name} has changed since this cache was made from it")
        except OSError:
            continue
    return reasons
