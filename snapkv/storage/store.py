"""The store: saved caches found again by content, in one folder (<snapkv home>/caches).

A cache's name is a hash of what decides its contents: the model, tokenizer and template, the
prompt's token ids, the tier kept at prefill and the file format's major version. The file format
itself is snapkv.storage.cachefile.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from snapkv.base.bits import Bits
from snapkv.base.errors import SnapKVError
from snapkv.base.paths import CACHE_SUFFIX as SUFFIX, snapkv_home
from snapkv.compression.config import Cut
from snapkv.storage.cachemeta import IDENTITY_FIELDS, PLAIN_FORMAT_VERSION, read_metadata


def cache_key(identity: dict, prompt_ids: "torch.Tensor", stored: Cut | None, bits: "Bits | int" = 16) -> str:
    """Content address: the model, tokenizer and template, the prompt, the stored tier and its bits, the
    format major."""
    import torch

    ids_digest = hashlib.sha256(prompt_ids.to(torch.int64).numpy().tobytes()).hexdigest()
    material = {
        "identity": {k: identity[k] for k in IDENTITY_FIELDS},
        "prompt_sha256": ids_digest,
        "stored": stored.to_dict() if stored else None,
        "bits": Bits.parse(bits).to_json(),
        "format_major": PLAIN_FORMAT_VERSION[0],  # format 3 added a sharper share, which the bits above name
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


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
        return removed
