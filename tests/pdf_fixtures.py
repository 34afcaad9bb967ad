"""A minimal PDF writer (text pages in Helvetica) and the hostile PDFs the tests feed snapkv. No dependencies."""

import zlib

FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def stream_object(content: bytes, dictionary: bytes = b"") -> bytes:
    return b"<< /Length %d %s>>\nstream\n" % (len(content), dictionary) + content + b"\nendstream"


def page_content(lines: list[str], font_size: int = 10, leading: int = 13) -> bytes:
    stream = [f"BT /F1 {font_size} Tf {leading} TL 50 800 Td".encode()]
    for line in lines:
        stream.append(f"({_escape(line)}) Tj T*".encode("latin-1", errors="replace"))
    stream.append(b"ET")
    return b"\n".join(stream)


def assemble(objects: list[bytes], *, root: int = 1, trailer: bytes = b"", with_xref: bool = True) -> bytes:
    """Objects numbered 1.. in order, an xref table and a trailer naming `root` as the catalog."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    if not with_xref:
        return bytes(out + b"trailer\n<< /Size %d /Root %d 0 R >>\n%%%%EOF\n" % (len(objects) + 1, root))
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root %d 0 R %s>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, root, trailer, xref)
    return bytes(out)


def pages_pdf(contents: list[bytes | None], *, content_dictionary: bytes = b"") -> bytes:
    """One page per entry: its content stream (None: a page with no content at all)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", FONT]
    page_ids = []
    for content in contents:
        contents_ref = b""
        if content is not None:
            objects.append(stream_object(content, content_dictionary))
            contents_ref = b"/Contents %d 0 R " % len(objects)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Resources << /Font << /F1 3 0 R >> >> "
                       + contents_ref + b">>")
        page_ids.append(len(objects))
    kids = b" ".join(b"%d 0 R" % page for page in page_ids)
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(page_ids))
    return assemble(objects)


def text_pdf(pages: list[list[str]], *, font_size: int = 10, leading: int = 13) -> bytes:
    """A PDF whose page i shows pages[i] line by line (Latin-1 text), with a correct xref table."""
    return pages_pdf([page_content(lines, font_size, leading) for lines in pages])


def _deflate_zeros(size: int) -> bytes:
    """zlib data that inflates to `size` zero bytes, made without holding them all in memory."""
    compressor = zlib.compressobj(9)
    chunk = bytes(2**20)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join(parts) + compressor.flush()


def flate_bomb_pdf(size: int = 2**30, nested: bool = False) -> bytes:
    """A page whose content stream inflates to `size` bytes (nested: compressed twice, two filters)."""
    data = _deflate_zeros(size)
    filters = b"/Filter /FlateDecode "
    if nested:
        data = zlib.compress(data, 9)
        filters = b"/Filter [/FlateDecode /FlateDecode] "
    return pages_pdf([data], content_dictionary=filters)


def prev_loop_pdf() -> bytes:
    """Two xref sections whose /Prev entries point at each other."""
    body = text_pdf([["Looping xref."]])
    first_xref = body.rindex(b"xref\n")
    trailer_at = body.rindex(b"trailer")
    second_xref = len(body)
    section = body[first_xref:trailer_at]
    looped = body[:trailer_at] + b"trailer\n<< /Size 6 /Root 1 0 R /Prev %d >>\nstartxref\n%d\n%%%%EOF\n" % (
        second_xref, first_xref)
    second_xref = len(looped)
    return looped + section + b"trailer\n<< /Size 6 /Root 1 0 R /Prev %d >>\nstartxref\n%d\n%%%%EOF\n" % (
        first_xref, second_xref)


def cyclic_page_tree_pdf() -> bytes:
    """A page tree whose node lists itself (and its parent) as kids."""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R 2 0 R] /Count 2 >>",
        b"<< /Type /Pages /Parent 2 0 R /Kids [2 0 R 3 0 R] /Count 2 >>",
    ]
    return assemble(objects)


def blank_pages_pdf(count: int) -> bytes:
    return pages_pdf([None] * count)


def image_only_pdf() -> bytes:
    """One page that paints a 2x2 grey image and no text."""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [5 0 R] /Count 1 >>",
        stream_object(b"\x80\x80\x80\x80", b"/Type /XObject /Subtype /Image /Width 2 /Height 2 "
                                             b"/ColorSpace /DeviceGray /BitsPerComponent 8 "),
        stream_object(b"q 200 0 0 200 100 400 cm /Im1 Do Q"),
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Resources << /XObject << /Im1 3 0 R >> >> "
        b"/Contents 4 0 R >>",
    ]
    return assemble(objects)


def encrypted_pdf(lines: list[str], *, user_password: str, owner_password: str, algorithm: str = "AES-256") -> bytes:
    """text_pdf encrypted by pypdf (user_password "" means anyone may open it: owner password only)."""
    import io

    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf([lines]))))
    writer.encrypt(user_password=user_password, owner_password=owner_password, algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()
