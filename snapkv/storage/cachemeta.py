"""A saved cache's metadata, read from the file's header alone: free of torch, so that commands that only
look at caches (info's header, cache list, compress's checks) start at once.

The metadata is checked as it is read (snapkv.storage.cacheschema); older formats of the same major version are returned
in the current schema. tier_of, per_question_of and recorded_sources read it into the settings and sources it
records; stored_tensor_names says which tensors a file of it holds (snapkv.storage.cachefile's layout).
"""

import json
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from snapkv.base.errors import CacheFileError, ConfigError
from snapkv.storage.cacheschema import SchemaError, check_metadata

if TYPE_CHECKING:  # imported where used, so that reading a header stays light (cache list, compress's checks)
    from snapkv.base.bits import Bits, Scheme
    from snapkv.compression.config import Cut, Tier
    from snapkv.io.documents import Source

FORMAT_NAME = "snapkv-cache"
FORMAT_VERSION = (5, 0)  # the newest this snapkv writes and reads
FORMED_FORMAT_VERSION = (5, 0)  # a kind's rotation or group size chosen in its bits ("8r/8", "8/4g32")
SPLIT_FORMAT_VERSION = (4, 0)  # keys in 16 bits and values in fewer ("16/8")
SHARP_FORMAT_VERSION = (3, 0)  # a sharper share
PLAIN_FORMAT_VERSION = (2, 0)  # every other file
MAX_HEADER_BYTES = 64 * 2**20
VERSION_TEXT = re.compile(r"(\d{1,4})\.(\d{1,4})")  # "4.0"
# Identity fields that must match for a saved cache to be reused, with what they mean to a user.
IDENTITY_FIELDS = {
    "model_type": "model family",
    "config_sha256": "model configuration",
    "weights_sha256": "model weights",
    "tokenizer_sha256": "tokenizer",
    "chat_template_sha256": "chat template",
    "rope": "RoPE settings",
}


# ---------------------------------------------------------------------------------------------- reading

def _upgrade_1(metadata: dict, minor: int) -> dict:
    """Format 1 metadata in the current schema. 1.0 recorded the prefill cut as "stored" and the session's
    settings beside it; 1.1 had "tier" and "per_question" already. Both stored keys and values plainly."""
    upgraded = {**metadata, "storage": {"bits": 16, "dtype": metadata.get("dtype"), "format": 1}}
    if minor == 0:
        stored, settings = metadata.get("stored"), metadata.get("settings") or {}
        if not isinstance(stored, (dict, type(None))) or not isinstance(settings, dict):
            raise SchemaError("stored", "format 1.0 settings must be objects")
        cut = {**stored, "method": "snapkv"} if stored else None
        per_question = None
        if metadata.get("mode") == "query-aware" and settings:
            per_question = {key: settings[key] for key in ("budget", "window", "kernel", "pooling") if key in settings}
            per_question["method"] = "snapkv"
        upgraded.update(tier={"cut": cut, "truncation": None}, per_question=per_question,
                        # format 1 knew only SnapKV, whose stored cut is made during the prefill
                        mode="query-aware" if per_question else "document-window" if cut else "full")
    return upgraded


def read_metadata(path: Path) -> dict:
    """The snapkv metadata of a saved cache, from its header alone; CacheFileError if it is not one.

    Older formats of the same major version are returned in the current schema.
    """
    path = Path(path)
    return metadata_of(path, read_header(path))


def read_header(path: Path) -> dict:
    """A safetensors file's header as it is written (each tensor's entry, and "__metadata__"), checked only to fit
    the file and to be JSON; CacheFileError if it is not."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise CacheFileError(f"{path}: too short to be a snapkv cache ({size} bytes)")
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > min(MAX_HEADER_BYTES, size - 8):
                raise CacheFileError(f"{path}: not a snapkv cache file (a header of {header_length} bytes does not fit the file)")
            header = _strict_json(file.read(header_length).decode("utf-8"))
    except FileNotFoundError as error:
        raise CacheFileError(f"{path}: no such cache file") from error
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CacheFileError(f"{path}: not a snapkv cache file (unreadable header)") from error
    except OSError as error:
        raise CacheFileError(f"{path}: cannot read ({error})") from error
    return header


def metadata_of(path: Path, header: dict) -> dict:
    """The snapkv metadata in a file's header (read_header), checked, in the current schema; CacheFileError naming
    `path` if it is not a snapkv cache's."""
    try:
        text = header["__metadata__"]["snapkv"]
        metadata = _strict_json(text)
    except (KeyError, TypeError) as error:
        raise CacheFileError(f"{path}: a safetensors file, but not a snapkv cache file") from error
    except (ValueError, RecursionError) as error:
        raise CacheFileError(f"{path}: damaged metadata (not valid JSON: {str(error)[:80]})") from error
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise CacheFileError(f"{path}: not a snapkv cache (format {metadata.get('format') if isinstance(metadata, dict) else None!r})")
    version = VERSION_TEXT.fullmatch(metadata["version"]) if isinstance(metadata.get("version"), str) else None
    if version is None or int(version[1]) < 1:
        raise CacheFileError(f"{path}: unreadable format version {str(metadata.get('version'))[:40]!r}")
    major, minor = int(version[1]), int(version[2])
    if major > FORMAT_VERSION[0]:
        raise CacheFileError(
            f"{path}: written by a newer snapkv (cache format {major}.{minor}; this snapkv reads formats 1.x to "
            f"{FORMAT_VERSION[0]}.x). Upgrade snapkv, or rebuild the cache with this version."
        )
    try:
        if major == 1:
            metadata = _upgrade_1(metadata, minor)
        check_metadata(metadata, major)
    except SchemaError as error:
        raise CacheFileError(f"{path}: damaged metadata ({error})") from None
    return metadata


def _strict_json(text: str):
    """json.loads refusing NaN and Infinity, which are not JSON (ValueError); JSON nested deeper than the stack
    allows raises RecursionError, which the callers refuse too."""
    def refused(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refused)


# ---------------------------------------------------------------------------------------------- interpreting

def tier_of(path: Path, metadata: dict) -> "Tier":
    """What the file holds, from its metadata."""
    from snapkv.compression.config import Tier

    try:
        return Tier.from_dict(metadata.get("tier") or {})
    except (ConfigError, TypeError, KeyError, AttributeError) as error:
        raise CacheFileError(f"{path}: damaged metadata (tier: {error})") from error


def per_question_of(path: Path, metadata: dict) -> "Cut | None":
    """The cut the file's answers are made with by default (None: decode against what it holds)."""
    from snapkv.compression.config import Cut

    data = metadata.get("per_question")
    try:
        return Cut.from_dict(data) if data else None
    except (ConfigError, TypeError, AttributeError) as error:
        raise CacheFileError(f"{path}: damaged metadata (per_question: {error})") from error


def recorded_sources(path: Path, metadata: dict) -> "list[Source]":
    """The documents a saved cache was made from, as its metadata records them."""
    from snapkv.io.documents import Source

    try:
        return [Source(**source) for source in metadata.get("sources") or []]
    except TypeError as error:
        raise CacheFileError(f"{path}: damaged metadata (sources: {error})") from error


def stored_layout(path, metadata: dict, tensor_names, layers: int) -> tuple["Bits", int, int]:
    """A format 2+ file's (bits, head_dim, kv_heads), checked: the storage metadata readable and the file holding
    exactly the tensors its layout names; CacheFileError otherwise."""
    from snapkv.base.bits import Bits

    storage = metadata.get("storage") or {}
    head_dim, kv_heads = storage.get("head_dim"), storage.get("kv_heads")
    try:
        bits = Bits.parse(storage.get("bits"))
    except ValueError:
        bits = None
    if bits is None or not isinstance(head_dim, int) or not isinstance(kv_heads, int):
        raise CacheFileError(f"{path}: damaged metadata (storage {storage!r})")
    if set(tensor_names) != stored_tensor_names(layers, bits):
        raise CacheFileError(f"{path}: damaged cache (tensors missing or unexpected)")
    return bits, head_dim, kv_heads


def storage_scheme(path, storage: dict, kind: str) -> "Scheme":
    """How a file's `kind` ("keys", "sharp_values", ...) is quantized, from its storage metadata; CacheFileError
    naming the file where that is unreadable."""
    from snapkv.base.bits import Scheme

    try:
        return Scheme.from_dict(storage[kind])
    except (KeyError, TypeError, ValueError) as error:
        raise CacheFileError(f"{path}: damaged metadata (storage of {kind}: {error})") from error


def stored_tensor_names(layers: int, bits: "Bits | None") -> set[str]:
    """The tensors a file of `layers` layers holds (snapkv.storage.cachefile's layout): bits None for format 1 (each layer's
    keys, values and positions as plain tensors), else each layer's kept-positions mask and its keys and values in
    their bits (a 16-bit tensor, or codes, scale and minimum; a sharper share's mask and parts besides)."""
    if bits is None:
        return {"token_ids"} | {f"layers.{i}.{part}" for i in range(layers) for part in ("keys", "values", "positions")}
    parts = {kind: ("",) if kind_bits == 16 else (".codes", ".scale", ".minimum")
             for kind, kind_bits in (("keys", bits.keys), ("values", bits.values))}
    if bits.share:
        parts = {kind: found + (".sharp_mask", ".sharp_codes", ".sharp_scale", ".sharp_minimum")
                 for kind, found in parts.items()}
    return {"token_ids"} | {f"layers.{i}.{kind}{part}" for i in range(layers) for kind in ("keys", "values")
                            for part in parts[kind]} | {f"layers.{i}.kept" for i in range(layers)}
