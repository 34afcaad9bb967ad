"""Saved caches: one validated safetensors file per prompt, written atomically, found again by content.

File layout (safetensors, never pickle):
    layers.{i}.keys / layers.{i}.values   (kv_heads, kept, head_dim), the model's dtype, RoPE applied
    layers.{i}.positions                  (kv_heads, kept) int32, original positions
    token_ids                             (original_length,) int32, the prompt
    __metadata__["snapkv"]                JSON: format, version, model identity, settings, sources,
                                          producer versions and a digest of the tensor payload
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .cache import CompressedCache
from .documents import Source
from .errors import CacheFileError, IncompatibleCacheError, SnapKVError, StorageError
from .paths import snapkv_home

FORMAT_NAME = "snapkv-cache"
FORMAT_VERSION = (1, 0)
SUFFIX = ".snapkv"
MAX_HEADER_BYTES = 64 * 2**20
STALE_TEMP_SECONDS = 3600
# Identity fields that must match for a saved cache to be reused, with what they mean to a user.
IDENTITY_FIELDS = {
    "model_type": "model family",
    "config_sha256": "model configuration",
    "weights_sha256": "model weights",
    "tokenizer_sha256": "tokenizer",
    "chat_template_sha256": "chat template",
    "rope": "RoPE settings",
}


def payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return digest.hexdigest()


def cache_tensors(cache: CompressedCache) -> dict[str, torch.Tensor]:
    tensors = {"token_ids": cache.token_ids.to(device="cpu", dtype=torch.int32).contiguous()}
    for index, (keys, values, positions) in enumerate(zip(cache.keys, cache.values, cache.positions)):
        tensors[f"layers.{index}.keys"] = keys.detach().cpu().contiguous()
        tensors[f"layers.{index}.values"] = values.detach().cpu().contiguous()
        tensors[f"layers.{index}.positions"] = positions.to(device="cpu", dtype=torch.int32).contiguous()
    return tensors


def cache_key(identity: dict, prompt_ids: torch.Tensor, stored_settings: dict | None) -> str:
    """Content address: the model, tokenizer and template, the prompt, the stored tier, the format major."""
    ids_digest = hashlib.sha256(prompt_ids.to(torch.int64).numpy().tobytes()).hexdigest()
    material = {
        "identity": {k: identity[k] for k in IDENTITY_FIELDS},
        "prompt_sha256": ids_digest,
        "stored": stored_settings,
        "format_major": FORMAT_VERSION[0],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------- writing

@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so two writers of one file never interleave."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temps(folder: Path) -> int:
    """Remove temp files left by writers that died (their process is gone, or they are an hour old)."""
    removed = 0
    for temp in folder.glob(".*.tmp"):
        parts = temp.name.split(".")
        try:
            pid = int(parts[-3])
        except (ValueError, IndexError):
            continue
        try:
            old = time.time() - temp.stat().st_mtime > STALE_TEMP_SECONDS
        except FileNotFoundError:
            continue
        if old or not _pid_alive(pid):
            temp.unlink(missing_ok=True)
            removed += 1
    return removed


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_cache(path: Path, cache: CompressedCache, metadata: dict) -> int:
    """Write `cache` to `path` atomically; returns the file's size in bytes.

    Temp file in the same folder, fsync, rename over the final name, fsync the folder: a crash at any
    point leaves the old file or the new one, never a mix.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = cache_tensors(cache)
    header = {
        **metadata,
        "format": FORMAT_NAME,
        "version": f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}",
        "original_length": cache.original_length,
        "num_layers": cache.num_layers,
        "dtype": str(cache.keys[0].dtype).replace("torch.", ""),
        "payload_sha256": payload_digest(tensors),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            sweep_stale_temps(path.parent)
            temp = _temp_name(path)
            try:
                save_file(tensors, str(temp), metadata={"snapkv": json.dumps(header)})
                with open(temp, "rb+") as written:
                    os.fsync(written.fileno())
                os.replace(temp, path)
                _fsync_folder(path.parent)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
        return path.stat().st_size
    except OSError as error:
        raise StorageError(_write_failure(path, error)) from error


def _write_failure(path: Path, error: OSError) -> str:
    """What a failed write means for the user; the previous file, if any, is untouched either way."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "the disk is full; free some space"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = "the folder cannot be written; check its permissions or set SNAPKV_HOME to a writable folder"
    elif error.errno in (errno.ENOTDIR, errno.EEXIST):
        reason = "a file stands where a folder is needed; move it or set SNAPKV_HOME elsewhere"
    else:
        reason = error.strerror or str(error)
    return f"cannot save the cache to {path}: {reason}. Any earlier file there is intact."


# ---------------------------------------------------------------------------------------------- reading

def read_metadata(path: Path) -> dict:
    """The snapkv metadata of a saved cache, from its header alone; CacheFileError if it is not one."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise CacheFileError(f"{path}: too short to be a snapkv cache ({size} bytes)")
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > min(MAX_HEADER_BYTES, size - 8):
                raise CacheFileError(f"{path}: not a snapkv cache (header length {header_length} does not fit the file)")
            header = json.loads(file.read(header_length).decode("utf-8"))
    except FileNotFoundError as error:
        raise CacheFileError(f"{path}: no such cache file") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CacheFileError(f"{path}: not a snapkv cache (unreadable header)") from error
    except OSError as error:
        raise CacheFileError(f"{path}: cannot read ({error})") from error
    try:
        metadata = json.loads(header["__metadata__"]["snapkv"])
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise CacheFileError(f"{path}: a safetensors file, but not a snapkv cache") from error
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise CacheFileError(f"{path}: not a snapkv cache (format {metadata.get('format') if isinstance(metadata, dict) else None!r})")
    try:
        major, minor = (int(part) for part in str(metadata.get("version", "")).split("."))
    except ValueError as error:
        raise CacheFileError(f"{path}: unreadable format version {metadata.get('version')!r}") from error
    if major > FORMAT_VERSION[0]:
        raise CacheFileError(
            f"{path}: written by a newer snapkv (cache format {major}.{minor}; this snapkv reads "
            f"{FORMAT_VERSION[0]}.x). Upgrade snapkv, or rebuild the cache with this version."
        )
    return metadata


def check_identity(path: Path, metadata: dict, identity: dict) -> None:
    """Refuse a cache made for another model, tokenizer or template, saying what differs."""
    saved = metadata.get("model", {})
    differing = [label for key, label in IDENTITY_FIELDS.items() if saved.get(key) != identity.get(key)]
    if differing:
        raise IncompatibleCacheError(
            f"{path} was made with {saved.get('name', 'another model')!r}, and its {', '.join(differing)} "
            f"differ from {identity.get('name')!r}, the model in use. Use the model it was made with, "
            "or ask the original document again to build a new cache."
        )


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity: the extremes tell (NaN propagates into them), 6x faster than isfinite().all()."""
    if not tensor.numel():
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def _validate_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict, identity: dict | None) -> None:
    length = metadata.get("original_length")
    layers = metadata.get("num_layers")
    if not isinstance(length, int) or not isinstance(layers, int) or length < 1 or layers < 1:
        raise CacheFileError(f"{path}: damaged metadata (length {length!r}, layers {layers!r})")
    expected = {"token_ids"} | {f"layers.{i}.{part}" for i in range(layers) for part in ("keys", "values", "positions")}
    if set(tensors) != expected:
        raise CacheFileError(f"{path}: damaged cache (tensors missing or unexpected)")
    if tensors["token_ids"].shape != (length,):
        raise CacheFileError(f"{path}: damaged cache (prompt ids do not match its length)")
    if identity is not None and layers != identity["num_layers"]:
        raise IncompatibleCacheError(f"{path}: has {layers} layers, the model in use has {identity['num_layers']}")
    for index in range(layers):
        keys, values = tensors[f"layers.{index}.keys"], tensors[f"layers.{index}.values"]
        positions = tensors[f"layers.{index}.positions"]
        if keys.dim() != 3 or keys.shape != values.shape or positions.shape != keys.shape[:2]:
            raise CacheFileError(f"{path}: damaged cache (layer {index} shapes {tuple(keys.shape)}, "
                                 f"{tuple(values.shape)}, {tuple(positions.shape)})")
        if identity is not None and (keys.shape[0], keys.shape[2]) != (identity["kv_heads"], identity["head_dim"]):
            raise IncompatibleCacheError(f"{path}: layer {index} has {keys.shape[0]} KV heads of size {keys.shape[2]}, "
                                         f"the model in use {identity['kv_heads']} of size {identity['head_dim']}")
        if positions.numel() and (positions.min() < 0 or positions.max() >= length
                                  or bool((positions[:, 1:] <= positions[:, :-1]).any())):
            raise CacheFileError(f"{path}: damaged cache (layer {index} positions out of order or range)")
        if not (_all_finite(keys) and _all_finite(values)):
            raise CacheFileError(f"{path}: damaged cache (layer {index} holds NaN or infinite values)")


def load_cache(path: Path, *, identity: dict | None = None,
               device: torch.device | str | list[torch.device] = "cpu",
               dtype: torch.dtype | None = None, verify: bool = True) -> tuple[CompressedCache, dict]:
    """Read and validate a saved cache; refuse (CacheFileError / IncompatibleCacheError) what does not fit.

    identity: the model in use (LoadedModel.identity); None skips the model checks (for `info`).
    device:   one device for every layer, or one per layer (LoadedModel.layer_devices): a file saved
              from any layout loads into any other.
    verify:   check the payload digest (reads every byte; skip only for very large trusted files).
    """
    from safetensors.torch import load_file

    path = Path(path)
    metadata = read_metadata(path)
    if identity is not None:
        check_identity(path, metadata, identity)
    try:
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises its own error type for every structural fault
        raise CacheFileError(f"{path}: damaged cache file ({error})") from error
    if verify and payload_digest(tensors) != metadata.get("payload_sha256"):
        raise CacheFileError(f"{path}: damaged cache (its contents do not match their digest); delete it and rebuild")
    _validate_tensors(path, tensors, metadata, identity)
    layers = metadata["num_layers"]
    devices = list(device) if isinstance(device, (list, tuple)) else [device] * layers
    if len(devices) != layers:
        raise IncompatibleCacheError(f"{path}: has {layers} layers, the model in use has {len(devices)}")
    cache = CompressedCache(
        keys=[tensors[f"layers.{i}.keys"].to(device=devices[i], dtype=dtype) for i in range(layers)],
        values=[tensors[f"layers.{i}.values"].to(device=devices[i], dtype=dtype) for i in range(layers)],
        positions=[tensors[f"layers.{i}.positions"].to(device=devices[i], dtype=torch.int64) for i in range(layers)],
        original_length=metadata["original_length"],
        token_ids=tensors["token_ids"].to(torch.int64),
    )
    return cache, metadata


def recorded_sources(path: Path, metadata: dict) -> list[Source]:
    """The documents a saved cache was made from, as its metadata records them."""
    try:
        return [Source(**source) for source in metadata.get("sources") or []]
    except TypeError as error:
        raise CacheFileError(f"{path}: damaged metadata (sources: {error})") from error


# ---------------------------------------------------------------------------------------------- the store

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

    def remove(self, key: str) -> bool:
        path = self.path_for(key)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".lock").unlink(missing_ok=True)
        return existed

    def clear(self) -> int:
        removed = 0
        for entry in self.entries():
            removed += self.remove(entry.key)
        return removed
