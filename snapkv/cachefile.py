"""The saved-cache file format: one safetensors file, its metadata schema, its validation and digest.

File layout (safetensors, never pickle):
    layers.{i}.keys / layers.{i}.values   (kv_heads, kept, head_dim), RoPE applied
    layers.{i}.positions                  (kv_heads, kept) int32, original positions
    token_ids                             (original_length,) int32, the prompt
    __metadata__["snapkv"]                JSON, written from the cache it describes (build_metadata):
        format, version               "snapkv-cache", "MAJOR.MINOR"
        model                         identity of the model, tokenizer and template (snapkv.fingerprint)
        tier                          what the file holds: {"cut": the prefill cut or null, "truncation"}
        per_question                  the cut made per question when answering (query-aware), or null
        mode                          full | document-window | query-aware (from tier and per_question)
        sources                       the documents, with sha256 (staleness)
        original_length, num_layers, dtype, producer, created, payload_sha256

This module owns the schema: nothing else writes or interprets these keys. The store folder
(naming, look-up, listing) is snapkv.store; the atomic write is snapkv.atomic.
"""

import hashlib
import json
import struct
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .atomic import write_atomically
from .cache import CompressedCache
from .config import Cut, Tier, mode_of
from .documents import Source
from .errors import CacheFileError, ConfigError, IncompatibleCacheError

FORMAT_NAME = "snapkv-cache"
FORMAT_VERSION = (1, 1)
SUFFIX = ".snapkv"
MAX_HEADER_BYTES = 64 * 2**20
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


def build_metadata(cache: CompressedCache, *, model: dict | None = None, per_question: Cut | None = None,
                   sources: list[Source] = ()) -> dict:
    """The metadata of a file holding `cache`: everything about the tier comes from the cache itself."""
    import transformers

    from . import __version__

    return {
        "format": FORMAT_NAME,
        "version": f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}",
        "model": model or {},
        "tier": cache.tier.to_dict(),
        "per_question": per_question.to_dict() if per_question else None,
        "mode": mode_of(cache.tier.cut, per_question),
        "sources": [asdict(source) for source in sources],
        "original_length": cache.original_length,
        "num_layers": cache.num_layers,
        "dtype": str(cache.keys[0].dtype).replace("torch.", ""),
        "producer": {"snapkv": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "created": time.time(),
    }


def save_cache(path: Path, cache: CompressedCache, *, model: dict | None = None, per_question: Cut | None = None,
               sources: list[Source] = ()) -> int:
    """Write `cache` to `path` atomically; returns the file's size in bytes.

    model: the identity of the model that made it (LoadedModel.identity); per_question: the cut its
    answers are made with by default; sources: the documents it was made from.
    """
    from safetensors.torch import save_file

    tensors = cache_tensors(cache)
    header = build_metadata(cache, model=model, per_question=per_question, sources=sources)
    header["payload_sha256"] = payload_digest(tensors)
    return write_atomically(
        path, lambda temp: save_file(tensors, str(temp), metadata={"snapkv": json.dumps(header)}), "the cache")


# ---------------------------------------------------------------------------------------------- reading

def _upgrade_1_0(metadata: dict) -> dict:
    """Format 1.0 recorded the prefill cut as "stored" and the session's settings beside it."""
    stored, settings = metadata.get("stored"), metadata.get("settings") or {}
    cut = {**stored, "method": "snapkv"} if stored else None
    per_question = None
    if metadata.get("mode") == "query-aware" and settings:
        per_question = {key: settings[key] for key in ("budget", "window", "kernel", "pooling") if key in settings}
        per_question["method"] = "snapkv"
    return {**metadata, "tier": {"cut": cut, "truncation": None}, "per_question": per_question,
            "mode": mode_of(cut, per_question)}


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
    if (major, minor) == (1, 0):
        metadata = _upgrade_1_0(metadata)
    return metadata


def tier_of(path: Path, metadata: dict) -> Tier:
    """What the file holds, from its metadata."""
    try:
        return Tier.from_dict(metadata.get("tier") or {})
    except (ConfigError, TypeError, KeyError, AttributeError) as error:
        raise CacheFileError(f"{path}: damaged metadata (tier: {error})") from error


def per_question_of(path: Path, metadata: dict) -> Cut | None:
    """The cut the file's answers are made with by default (None: decode against what it holds)."""
    data = metadata.get("per_question")
    try:
        return Cut.from_dict(data) if data else None
    except (ConfigError, TypeError, AttributeError) as error:
        raise CacheFileError(f"{path}: damaged metadata (per_question: {error})") from error


def recorded_sources(path: Path, metadata: dict) -> list[Source]:
    """The documents a saved cache was made from, as its metadata records them."""
    try:
        return [Source(**source) for source in metadata.get("sources") or []]
    except TypeError as error:
        raise CacheFileError(f"{path}: damaged metadata (sources: {error})") from error


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
    tier = tier_of(path, metadata)
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
        tier=tier,
    )
    return cache, metadata
