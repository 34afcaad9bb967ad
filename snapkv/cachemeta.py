"""A saved cache's metadata, read from the file's header alone: free of torch, so that commands that only
look at caches (info's header, cache list, compress's checks) start at once.

The metadata is checked as it is read (snapkv.cacheschema); older formats of the same major version are returned
in the current schema.
"""

import json
import re
import struct
from pathlib import Path

from .cacheschema import SchemaError, check_metadata
from .errors import CacheFileError

FORMAT_NAME = "snapkv-cache"
FORMAT_VERSION = (4, 0)  # the newest this snapkv writes and reads
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
