"""A store several machines share: the caches under an fsspec URL (s3://bucket/prefix, gs://..., memory://...), each
fetched whole into the local store the first time it is asked for, then read there as any saved cache, and published
to the URL once it is saved.

    open_store(spec)   a folder or a URL (SNAPKV_STORE when none is given; the local default when neither is)

Writes stay whole-or-absent: where the backend renames (memory://, and fsspec's other file systems that move
without copying) a cache is put under a temporary name beside its final one, then moved; object stores (s3, gs, az)
have no rename, and there the object is put under its final name in one request, which they make visible whole or
not at all. Two writers of one document make equal caches (the name is a hash of what decides the contents), so a
cache already there is not written again unless it was found unreadable. A folder, `file://` URL included, is the
local store itself: written by rename under a lock, as the default one.
"""

import os
import uuid
from pathlib import Path

from snapkv.base.atomic import write_atomically
from snapkv.base.errors import ConfigError, StorageError
from snapkv.base.paths import CACHE_SUFFIX as SUFFIX
from snapkv.storage.store import PREFIXES, CacheStore, StoreEntry, as_key

STORE_VARIABLE = "SNAPKV_STORE"
RENAMING_PROTOCOLS = ("memory",)  # object stores are not among them: a move there is a copy and a delete


class RemoteStore(CacheStore):
    """Caches under an fsspec URL, read through a local store (its folder: `local`, the default local store)."""

    def __init__(self, url: str, local: Path | None = None) -> None:
        super().__init__(local)
        try:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(url)
        except ImportError as error:  # a backend's own package: s3fs for s3://, gcsfs for gs://, ...
            raise ConfigError(f"the store {url} needs {error.name}: pip install {error.name}") from error
        except ValueError as error:
            raise ConfigError(f"the store {url} is not a URL fsspec knows ({error})") from error
        self.url = url
        self.remote_root = root.rstrip("/")
        protocol = self.fs.protocol
        self.renames = (protocol if isinstance(protocol, str) else protocol[0]) in RENAMING_PROTOCOLS

    @property
    def where(self) -> str:
        return self.url

    def remote_path(self, key: str) -> str:
        return f"{self.remote_root}/{key}{SUFFIX}"

    def lookup(self, key: str) -> Path | None:
        """The local copy of the cache, fetched whole from the URL when only the URL has it."""
        found = super().lookup(key)
        if found is not None:
            return found
        remote = self.remote_path(key)
        try:
            if not self.fs.exists(remote):
                return None
            write_atomically(self.path_for(key), lambda temp: self.fs.get_file(remote, str(temp)),
                             what=f"the cache fetched from {self.url}")
        except (OSError, ValueError) as error:  # a network or permission failure: prefilled as if it were absent
            raise StorageError(f"cannot read {remote} from the store {self.url}: {error}") from error
        return self.path_for(key)

    def publish(self, key: str, replace: bool = False) -> bool:
        """Put the saved local cache under the URL (whole or not at all); False where it is there already and not
        to be replaced."""
        local, remote = self.path_for(key), self.remote_path(key)
        try:
            if not replace and self.fs.exists(remote):
                return False  # a writer of the same document was first: its cache is this one
            self.fs.makedirs(self.remote_root, exist_ok=True)
            if self.renames:
                temporary = f"{self.remote_root}/.{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
                self.fs.put_file(str(local), temporary)
                self.fs.mv(temporary, remote)
            else:
                self.fs.put_file(str(local), remote)
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot write {remote} to the store {self.url}: {error}. The cache is saved on this "
                               "machine; other machines will prefill it themselves.") from error
        return True

    # ---- the prefix index, under the URL as in the local store (prefixes/<2 hex>/<chunk hash>)

    def _remote_entry(self, chunk_hash: str) -> str:
        return f"{self.remote_root}/{PREFIXES}/{chunk_hash[:2]}/{chunk_hash}"

    def _has_entry(self, chunk_hash: str) -> bool:
        if super()._has_entry(chunk_hash):
            return True
        try:
            return self.fs.exists(self._remote_entry(chunk_hash))
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot read the prefix index of the store {self.url}: {error}") from error

    def _read_entry(self, chunk_hash: str) -> str | None:
        """The key the URL's entry holds (another machine's newer cache may have replaced this machine's)."""
        try:
            return as_key(self.fs.cat_file(self._remote_entry(chunk_hash)))
        except FileNotFoundError:  # only here
            return super()._read_entry(chunk_hash)
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot read the prefix index of the store {self.url}: {error}") from error

    def _write_entries(self, entries: dict[str, str]) -> None:
        """Here and under the URL, in one request where the backend batches them (each entry is one small object,
        put whole)."""
        super()._write_entries(entries)
        try:
            for folder in {self._remote_entry(chunk_hash).rsplit("/", 1)[0] for chunk_hash in entries}:
                self.fs.makedirs(folder, exist_ok=True)
            self.fs.pipe({self._remote_entry(chunk_hash): key.encode() for chunk_hash, key in entries.items()})
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot write the prefix index to the store {self.url}: {error}. Other machines will "
                               "not find this cache by a shared prefix.") from error

    def entries(self) -> list[StoreEntry]:
        """The caches under the URL (size and time as the backend says; what they hold where a local copy exists)."""
        local = {entry.key: entry for entry in super().entries()}
        try:
            listed = self.fs.ls(self.remote_root, detail=True) if self.fs.exists(self.remote_root) else []
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot list the store {self.url}: {error}") from error
        found = []
        for item in listed:
            name = item["name"].rsplit("/", 1)[-1]
            if not name.endswith(SUFFIX) or name.startswith("."):  # a write under way
                continue
            key = name[: -len(SUFFIX)]
            mine = local.get(key)
            modified = item.get("mtime") or item.get("LastModified") or item.get("created") or 0
            modified = modified.timestamp() if hasattr(modified, "timestamp") else float(modified)
            found.append(StoreEntry(mine.path if mine else Path(item["name"]), key, int(item.get("size") or 0),
                                    modified, mine.metadata if mine else None))
        return sorted(found, key=lambda entry: entry.key)

    def clear(self) -> int:
        removed = super().clear()
        index = f"{self.remote_root}/{PREFIXES}"
        try:
            if self.fs.exists(index):
                self.fs.rm(index, recursive=True)
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot remove the prefix index of the store {self.url}: {error}") from error
        return removed

    def remove(self, key: str) -> bool:
        existed = super().remove(key)
        try:
            if self.fs.exists(self.remote_path(key)):
                self.fs.rm(self.remote_path(key))
                existed = True
        except (OSError, ValueError) as error:
            raise StorageError(f"cannot remove {key} from the store {self.url}: {error}") from error
        return existed


def open_store(spec: str | None = None) -> CacheStore:
    """The store `spec` names: a folder, or an fsspec URL (a file:// URL is the folder itself); None: SNAPKV_STORE,
    else <snapkv home>/caches."""
    spec = spec if spec is not None else os.environ.get(STORE_VARIABLE) or None
    if spec is None:
        return CacheStore()
    if spec.startswith("file://"):
        return CacheStore(Path(spec.removeprefix("file://")).expanduser())
    if "://" not in spec:
        return CacheStore(Path(spec).expanduser())
    return RemoteStore(spec)
