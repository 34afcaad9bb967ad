"""`snapkv pull`: a GGUF file fetched by URL (or a Hugging Face id and file name) into the snapkv home, resumable,
sha256-checked, and read as a GGUF before it is kept. The only network snapkv ever does, and only when asked.

The bytes go to `<home>/models/.<name>.gguf.part`; a pull that stops (Ctrl-C, a dropped connection) leaves that
part, and the next pull of the same file asks the server for the rest (an HTTP Range request; a server that answers
with the whole file starts it again). When the file is whole, its sha256 is checked (given, or the one Hugging Face
publishes for it), its header and every tensor read (snapkv.modeling.gguf_file), and only then is it renamed to
`<name>.gguf`: a file that fails a check is deleted, with a message that says which.
"""

import hashlib
import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from snapkv.base.errors import ConfigError, ModelFileError, SnapKVError, StorageError
from snapkv.base.paths import models_dir

CHUNK = 1 << 20
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class DownloadError(SnapKVError):
    """A download that could not be made or finished (the server, the network)."""

    exit_code = 3


@dataclass(frozen=True)
class Source:
    """What to fetch: the URL, the name it is kept under, and its sha256 where known (lowercase hex)."""

    url: str
    name: str
    sha256: str | None


def resolve(source: str, file: str | None = None, name: str | None = None, sha256: str | None = None) -> Source:
    """A URL, or a Hugging Face repository id with `file` (a .gguf in it): the URL to fetch, with its name (the file's
    stem unless `name`) and sha256 (`sha256`, else for a Hugging Face file the one its LFS pointer publishes, looked
    up with huggingface_hub). ConfigError for what cannot be one."""
    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise ConfigError(f"--sha256 {sha256!r} is not 64 hexadecimal digits")
    if re.match(r"^https?://", source):
        if file is not None:
            raise ConfigError("--file goes with a Hugging Face repository id, not a URL")
        url, known = source, sha256
        stem = Path(urllib.parse.urlparse(source).path).name
    else:
        if file is None or not file.endswith(".gguf") or not re.fullmatch(r"[\w.-]+/[\w.-]+", source):
            raise ConfigError(f"{source!r}: pass a URL, or a Hugging Face repository id (owner/name) with --file "
                              "NAME.gguf")
        from huggingface_hub import hf_hub_url

        url, known = hf_hub_url(source, file), sha256 or _published_sha256(source, file)
        stem = Path(file).name
    if not stem.endswith(".gguf"):
        raise ConfigError(f"{source}: snapkv pulls GGUF files (a name ending in .gguf); give --name to keep it "
                          "under another")
    chosen = name or stem[:-len(".gguf")]
    if not NAME.match(chosen):
        raise ConfigError(f"{chosen!r} cannot name a model file: letters, digits, '.', '_' and '-' only")
    return Source(url, chosen, known.lower() if known else None)


def _published_sha256(repository: str, file: str) -> str | None:
    """The sha256 Hugging Face publishes for a file kept in LFS (its ETag), or None (a file in git, no network)."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        etag = (get_hf_file_metadata(hf_hub_url(repository, file)).etag or "").strip('"')
    except Exception:  # no network, no such file: the download itself says what is wrong
        return None
    return etag.lower() if re.fullmatch(r"[0-9a-fA-F]{64}", etag) else None


def pull(source: Source, on_progress: Callable[[int, int | None], None] | None = None,
         timeout: float = 60.0) -> Path:
    """Fetch `source` into the models folder, going on from a part left by an earlier pull; the kept file's path.
    on_progress: (bytes so far, bytes in all or None). Raises DownloadError, ModelFileError (a sha256 that differs,
    not a GGUF: the file deleted) or StorageError."""
    folder = models_dir()
    target, part = folder / f"{source.name}.gguf", folder / f".{source.name}.gguf.part"
    if target.exists():
        raise StorageError(f"{target} exists already; delete it first to pull it again")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _fetch(source.url, part, on_progress or (lambda done, total: None), timeout)
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", None) or error
        raise DownloadError(f"{source.url}: {reason}; run the same command again to go on from the "
                            f"{part.stat().st_size if part.exists() else 0} bytes fetched") from error
    except OSError as error:
        raise StorageError(f"cannot write {part}: {error}") from error
    try:
        _check(source, part)
    except ModelFileError:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, target)
    return target


def _fetch(url: str, part: Path, on_progress: Callable[[int, int | None], None], timeout: float) -> None:
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and have:  # nothing past what is there: the part is whole
            return
        raise DownloadError(f"{url}: the server answered {error.code} {error.reason}") from error
    with response:
        resumed = response.status == 206
        if have and not resumed:
            have = 0  # the server sent the whole file: start again
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else None
        with open(part, "ab" if resumed else "wb") as out:
            done = have
            on_progress(done, total)
            while block := response.read(CHUNK):
                out.write(block)
                done += len(block)
                on_progress(done, total)
            out.flush()
            os.fsync(out.fileno())
    if total is not None and done != total:
        raise DownloadError(f"{url}: the connection ended after {done} of {total} bytes; run the same command again "
                            "to go on")


def _check(source: Source, part: Path) -> None:
    """The whole file's sha256 (where known) and its GGUF header and tensors; ModelFileError saying what failed."""
    from snapkv.modeling.gguf_file import GGUFFile

    if source.sha256 is not None:
        digest = hashlib.sha256()
        with open(part, "rb") as handle:
            while block := handle.read(CHUNK * 8):
                digest.update(block)
        if digest.hexdigest() != source.sha256:
            raise ModelFileError(f"{source.url}: the file's sha256 is {digest.hexdigest()}, not {source.sha256}: "
                                 "not kept (damaged, or another file)")
    GGUFFile(part)  # raises ModelFileError for a file that is not a whole, readable GGUF
