"""A prompt's document as passages a citation can name: each sentence, the prompt positions of its tokens, and where
it stands in the files it was read from (file name, page for a PDF, line).

Everything is recovered from the prompt's own token ids and the sources a cache records, so a cache loaded from a
file cites as well as one just made. The document text is the ids decoded; how snapkv.io.documents built it tells
where each file and page starts: in a folder, each file is headed "## <path in the folder>"; a PDF's pages are each
headed "[page N]". Lines count the text as read (for HTML and PDF, the text extracted; a PDF's within its page).
"""

import bisect
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from snapkv.compression.config import Truncation
from snapkv.io.documents import Source
from snapkv.io.facts import sentence_spans
from snapkv.io.streaming import TextStream

MAX_PASSAGE_CHARS = 600  # a longer sentence is cited in pieces
_PAGE_MARKER = re.compile(r"^\[page (\d+)\]$", re.MULTILINE)
_FILE_HEADER = re.compile(r"^## (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Passage:
    """One sentence of the document.

    positions: the prompt positions of its tokens
    source:    the recorded name of the file it is in (None where unknown: text sent over HTTP, a cut-off start)
    page:      its page, for a PDF
    line:      its first line, counted in the text read from the file (None where a truncation removed what
               precedes it)
    """

    text: str
    positions: range
    source: str | None
    page: int | None
    line: int | None


def decoded_with_offsets(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """(the ids' text, the index in it at which each id's text starts). A character split over several ids starts
    at the id that completes it."""
    stream = TextStream(tokenizer)
    pieces, starts, length = [], [], 0
    for token in ids:
        starts.append(length)
        piece = stream.add(token)
        pieces.append(piece)
        length += len(piece)
    pieces.append(stream.flush())
    return "".join(pieces), starts


@dataclass(frozen=True)
class _Region:
    """Where one source's text (or one page of it) starts in the document text, and its first line's number there."""

    start: int
    source: str | None
    page: int | None
    first_line: int | None  # the line number of the character at `start` (None: unknown)
    marker: int | None = None  # where the header or page marker before it starts (not a passage)


def _belongs(source: Source, header: str) -> bool:
    name = source.name.replace("\\", "/")
    return name == header or name.endswith("/" + header)


def _file_headers(text: str, sources: list[Source]) -> list[tuple[int, Source, int]]:
    """A folder's files in the text: (where the file's text starts, its source, where its header starts), in order.
    A header is a line "## <path in the folder>" naming one of the sources not yet found, then a blank line."""
    found, remaining = [], list(sources)
    for match in _FILE_HEADER.finditer(text):
        if not remaining or text[match.end():match.end() + 2] != "\n\n":
            continue
        at = next((i for i, source in enumerate(remaining) if _belongs(source, match.group(1))), None)
        if at is not None:  # the files before it (cut off by a truncation) are passed over
            found.append((match.end() + 2, remaining[at], match.start()))
            del remaining[: at + 1]
    return found


def _regions(text: str, sources: list[Source], start_known: bool) -> list[_Region]:
    """The regions of the document text, in order: a file's text (after its header, in a folder) and each PDF page.
    start_known: False where the document's start was cut off (the first region's lines are then unknown)."""
    headers = _file_headers(text, sources) if sources else []
    if len(sources) > 1 or (headers and headers[0][2] == 0):  # a folder (of one file, too)
        files = headers
        if not files or files[0][2] != 0:  # text before the first header found: its file is unknown
            files.insert(0, (0, None, None))
    else:
        files = [(0, sources[0] if sources else None, None)]
    regions = []
    for index, (start, source, header) in enumerate(files):
        stop = files[index + 1][0] if index + 1 < len(files) else len(text)
        name = source.name if source is not None else None
        known = header is not None or (start_known and (source is not None or not sources))
        regions.append(_Region(start, name, None, 1 if known else None, header))
        if source is not None and source.pages is not None:
            for match in _PAGE_MARKER.finditer(text, start, stop):
                regions.append(_Region(match.end() + 1, name, int(match.group(1)), 1, match.start()))
    return regions


def _capped(begin: int, end: int, text: str) -> list[tuple[int, int]]:
    """A sentence longer than MAX_PASSAGE_CHARS (a table, text without punctuation) in pieces that end at white space."""
    pieces = []
    while end - begin > MAX_PASSAGE_CHARS:
        cut = text.rfind(" ", begin + MAX_PASSAGE_CHARS // 2, begin + MAX_PASSAGE_CHARS)
        cut = cut if cut > begin else begin + MAX_PASSAGE_CHARS
        pieces.append((begin, cut))
        begin = cut
        while begin < end and text[begin].isspace():
            begin += 1
    return pieces + [(begin, end)] if begin < end else pieces


def document_passages(tokenizer, token_ids: torch.Tensor, document: range, sources: list[Source],
                      truncation: Truncation | None = None) -> list[Passage]:
    """The passages of the document at `document` in a prompt's token_ids (n,), read from `sources`.

    A truncated document's lines are known only before the cut (none where its start was cut off)."""
    ids = token_ids[document.start:document.stop].tolist()
    text, starts = decoded_with_offsets(tokenizer, ids)
    side = truncation.side if truncation is not None else None
    # where the middle was cut out: lines after it, up to the next file or page, are unknown
    cut = starts[len(ids) // 2] if side == "middle" and ids else len(text) + 1
    regions = _regions(text, sources, start_known=side != "start")
    breaks = [match.start() for match in re.finditer("\n", text)]
    passages = []
    for index, region in enumerate(regions):  # sentences never run over a file's header or a page's marker
        following = regions[index + 1] if index + 1 < len(regions) else None
        stop = len(text) if following is None else following.marker if following.marker is not None else following.start
        spans = sentence_spans(text[region.start:stop])
        for begin, end in (piece for a, b in spans for piece in _capped(a + region.start, b + region.start, text)):
            first_token = bisect.bisect_right(starts, begin) - 1
            last_token = bisect.bisect_left(starts, end)  # exclusive
            line = None
            if region.first_line is not None and not region.start <= cut <= begin:
                line = region.first_line + bisect.bisect_left(breaks, begin) - bisect.bisect_left(breaks, region.start)
            passages.append(Passage(" ".join(text[begin:end].split()),
                                    range(document.start + first_token, document.start + last_token),
                                    region.source, region.page, line))
    return passages


def display_name(source: str | None) -> str:
    """A recorded source name as a user reads it: relative to the current folder where it lies under it."""
    if source is None:
        return "the document"
    try:
        return str(Path(source).relative_to(Path.cwd()))
    except ValueError:
        return source
