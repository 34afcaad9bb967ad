"""The store: saved caches found again by content, in one folder (<snapkv home>/caches).

A cache's name is a hash of what decides its contents: the model, tokenizer and template, the
prompt's token ids, the tier kept at prefill and the file format's major version. The file format
itself is snapkv.storage.cachefile.

Beside the caches, prefixes/ indexes each saved prompt by chained hashes of its chunks (snapkv.storage.prefixes), so
that a new prompt finds the saved one it shares the longest prefix with in a few look-ups.
"""

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from snapkv.base.bits import Bits
from snapkv.base.errors import SnapKVError, StorageError
from snapkv.base.paths import CACHE_SUFFIX as SUFFIX, snapkv_home
from snapkv.compression.config import Cut
from snapkv.storage.cachemeta import IDENTITY_FIELDS, PLAIN_FORMAT_VERSION, read_metadata
from snapkv.storage.prefixes import chunk_chain, longest_present

PREFIXES = "prefixes"  # the folder of the prefix index, beside the caches


def _material(identity: dict, stored: Cut | None, bits: "Bits | int") -> dict:
    """What decides a cache's contents besides its prompt: the model, tokenizer and template, the stored tier and its
    bits, the format major."""
    return {
        "identity": {k: identity[k] for k in IDENTITY_FIELDS},
        "stored": stored.to_dict() if stored else None,
        "bits": Bits.parse(bits).to_json(),
        "format_major": PLAIN_FORMAT_VERSION[0],  # format 3 added a sharper share, which the bits above name
    }


def cache_key(identity: dict, prompt_ids: "torch.Tensor", stored: Cut | None, bits: "Bits | int" = 16) -> str:
    """Content address: what decides the contents (_material) and the prompt."""
    import torch

    ids_digest = hashlib.sha256(prompt_ids.to(torch.int64).numpy().tobytes()).hexdigest()
    material = {**_material(identity, stored, bits), "prompt_sha256": ids_digest}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def prefix_seed(identity: dict, stored: Cut | None, bits: "Bits | int" = 16) -> str:
    """The seed of a prompt's chunk hashes (snapkv.storage.prefixes): a prefix is shared only between caches of the
    same model, template, tier and bits."""
    material = {**_material(identity, stored, bits), "index": "prefixes"}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def as_key(data: bytes) -> str | None:
    """A prefix entry's content as a cache key (32 hex digits), None where it is not one."""
    key = data.decode("ascii", "replace").strip()
    return key if len(key) == 32 and all(c in "0123456789abcdef" for c in key) else None


@dataclass(frozen=True)
class StoreEntry:
    path: Path
    key: str
    size: int
    modified: float
    metadata: dict | None  # None when the file is not a readable snapkv cache


class CacheStore:
    """Content-addressed caches under <snapkv home>/caches."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else snapkv_home() / "caches"

    @property
    def where(self) -> str:
        """The store as a user names it: its folder (a URL for a shared one)."""
        return str(self.root)

    def path_for(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def lookup(self, key: str) -> Path | None:
        path = self.path_for(key)
        return path if path.is_file() else None

    # ---- the prefix index (snapkv.storage.prefixes): prefixes/<2 hex>/<chunk hash> holds a cache's key

    def index_prefixes(self, seed: str, prompt_ids: "torch.Tensor", key: str) -> None:
        """Record the saved cache `key` under each chunk hash of its prompt (the newest writer's key wins)."""
        self._write_entries({chunk_hash: key for chunk_hash in chunk_chain(seed, prompt_ids)})

    def longest_prefix(self, seed: str, prompt_ids: "torch.Tensor") -> tuple[Path, int] | None:
        """(the saved cache sharing the most leading chunks with this prompt, those chunks) or None: found in about
        log2(chunks) + 1 look-ups. The cache's own ids say how many tokens it really shares."""
        chain = chunk_chain(seed, prompt_ids)
        chunks = longest_present(chain, self._has_entry)
        if not chunks:
            return None
        key = self._read_entry(chain[chunks - 1])
        path = self.lookup(key) if key else None
        return (path, chunks) if path is not None else None

    def _entry_path(self, chunk_hash: str) -> Path:
        return self.root / PREFIXES / chunk_hash[:2] / chunk_hash

    def _has_entry(self, chunk_hash: str) -> bool:
        return self._entry_path(chunk_hash).is_file()

    def _read_entry(self, chunk_hash: str) -> str | None:
        """The key an entry holds (None where it is gone or is not a key)."""
        try:
            return as_key(self._entry_path(chunk_hash).read_bytes())
        except OSError:
            return None

    def _write_entries(self, entries: dict[str, str]) -> None:
        """Entries ({chunk hash: key}), each written whole or not at all (a temp file renamed over it); not synced: a
        lost one costs a prefill, never an answer."""
        try:
            for chunk_hash, key in entries.items():
                path = self._entry_path(chunk_hash)
                path.parent.mkdir(parents=True, exist_ok=True)
                temp = path.with_name(f".{chunk_hash}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
                temp.write_text(key)
                os.replace(temp, path)
        except OSError as error:
            raise StorageError(f"cannot write the prefix index under {self.root / PREFIXES}: {error}") from error

    def entries(self) -> list[StoreEntry]:
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                metadata = read_metadata(path)
            except SnapKVError:
                metadata = None
            stat = path.stat()
            found.append(StoreEntry(path, path.stem, stat.st_size, stat.st_mtime, metadata))
        return found

    def publish(self, key: str, replace: bool = False) -> bool:
        """Share the cache saved at path_for(key) where the store is shared with other machines (snapkv.storage.remote);
        a folder holds it already: False."""
        return False

    def remove(self, key: str) -> bool:
        path = self.path_for(key)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".lock").unlink(missing_ok=True)  # a lock file of snapkv before 0.2
        return existed

    def clear(self) -> int:
        removed = 0
        for entry in self.entries():
            removed += self.remove(entry.key)
        shutil.rmtree(self.root / PREFIXES, ignore_errors=True)
        return removed
