"""PDF text extraction in a child process with a memory and CPU-time limit: `python -m snapkv.io.pdf_worker`.

A malformed or hostile PDF (a decompression bomb, an xref loop, a pypdf bug not yet fixed) can at worst
exhaust this child's limits; the parent (snapkv.io.documents.pdf_to_text) kills it on its wall-clock limit
and reports what happened.

Protocol: stdin carries one JSON line {"password": str | null, "memory_bytes": int, "cpu_seconds": int},
then the PDF's bytes. stdout gets one JSON object: {"ok": true, "pages": [text, ...]} or
{"ok": false, "kind": "password" | "wrong_password" | "limit" | "loop" | "memory" | "dependency" |
"unreadable", "detail": str}.
"""

import io
import json
import resource
import sys


def _limit(kind: int, value: int) -> None:
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, hard))


def extract_pages(data: bytes, password: str | None) -> dict:
    """Every page's text, or what went wrong as a kind and a detail."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, LimitReachedError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and reader.decrypt(password or "") == 0:
            return {"ok": False, "kind": "wrong_password" if password else "password", "detail": ""}
        return {"ok": True, "pages": [page.extract_text() or "" for page in reader.pages]}
    except LimitReachedError as error:
        return {"ok": False, "kind": "limit", "detail": str(error)}
    except RecursionError:
        return {"ok": False, "kind": "loop", "detail": "its object structure refers back to itself"}
    except MemoryError:
        return {"ok": False, "kind": "memory", "detail": ""}
    except DependencyError as error:
        return {"ok": False, "kind": "dependency", "detail": str(error)}
    except Exception as error:  # any pypdf failure is a property of the file, reported to the parent
        return {"ok": False, "kind": "unreadable", "detail": f"{type(error).__name__}: {error}"}


def main() -> None:
    request = json.loads(sys.stdin.buffer.readline())
    data = sys.stdin.buffer.read()
    _limit(resource.RLIMIT_AS, int(request["memory_bytes"]))
    _limit(resource.RLIMIT_CPU, int(request["cpu_seconds"]))
    sys.setrecursionlimit(5000)
    result = extract_pages(data, request.get("password"))
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
