"""The saved-cache file format: one safetensors file, its metadata schema, its validation and digest.

File layout, format 2 and 3 (safetensors, never pickle):
    token_ids                         (original_length,) int32, the prompt
    layers.{i}.kept                   (kv_heads, ceil(original_length / 8)) uint8: bit p % 8 of byte p // 8
                                      is set where position p is kept (every head keeps as many)
    16 bits: layers.{i}.keys, .values (kv_heads, kept, head_dim) float16 or bfloat16, RoPE applied
    2-8 bits: layers.{i}.keys.codes / .scale / .minimum, the same for values: snapkv.storage.quantize.Quantized
                                      (keys grouped along tokens, values along channels)
    a sharper share (format 3): layers.{i}.keys.sharp_mask (kv_heads, ceil(kept / 8)) uint8, bit j set where
                                      the j-th held position is in the share, and its parts in their own bits
                                      as layers.{i}.keys.sharp_codes / .sharp_scale / .sharp_minimum (the
                                      rest stays in .codes / .scale / .minimum); the same for values
    __metadata__["snapkv"]            JSON, written from the cache it describes (build_metadata):
        format, version               "snapkv-cache", "MAJOR.MINOR"
        model                         identity of the model, tokenizer and template (snapkv.base.fingerprint)
        tier                          what the file holds: {"cut": the cut that chose its positions or
                                      null, "bits", "truncation"}
        storage                       {"bits", "dtype" (16 bits), "keys" and "values": quantization schemes,
                                      "sharp_keys" and "sharp_values": those of a sharper share}
        per_question                  the cut made per question when answering (query-aware), or null
        mode                          full | document-window | tier-only | query-aware (snapkv.compression.config.mode_of)
        document_span                 [start, stop) of the document in the prompt
        sources                       the documents, with sha256 (staleness)
        original_length, num_layers, producer, created, payload_sha256 (payload_digest), payload_sha256_lanes
                                      ({"lanes", "sha256"}: the same bytes hashed in runs at once),
                                      payload_xxh3_128 (payload_checksum): the newest of the three present
                                      is checked
    16/8 bits (format 4): layers.{i}.keys as at 16 bits, layers.{i}.values as at 8 bits; storage holds the
                                      keys' "dtype" and the values' scheme
    a kind's form (format 5): tier.bits says it ("8r/8": 8-bit keys rotated; "8/4g32": values in groups of
                                      32), and storage's schemes hold what it means
A file is written in the oldest format that holds it: 3.0 only with a sharper share, 4.0 only with keys in 16
bits and values in fewer, 5.0 only with a kind's rotation or group size chosen in its bits, so that snapkv
versions before them read every other file and refuse these asking for an upgrade. Format 1 (snapkv 0.1:
positions as int32, keys and values in the model's dtype) is still read.

This module owns the schema: nothing else writes these keys. What a reader needs without torch lives apart and is
used here too: the metadata read and interpreted (snapkv.storage.cachemeta: tier_of, per_question_of, stored_tensor_names),
the digests (snapkv.base.digests), the checks of a file's tensors (snapkv.storage.cachechecks: load_cache and
snapkv.storage.cacheinfo, which describes a file from its raw bytes for snapkv info, run the same ones). The store
folder (naming, look-up, listing) is snapkv.storage.store; the atomic write is snapkv.base.atomic.
"""

import ctypes
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from snapkv import native
from snapkv.base.atomic import write_atomically
from snapkv.base.digests import (DIGEST_LANES, text_digest, MAX_DIGEST_LANES, Piece, check_payload,  # noqa: F401 (re-exported)
                                 checksum_of, piece_header, sha256_of)
from snapkv.base.errors import CacheFileError, IncompatibleCacheError
from snapkv.base.paths import CACHE_SUFFIX
from snapkv.compression.config import Cut, mode_of
from snapkv.io.documents import Source
from snapkv.storage.cache import CompressedCache
from snapkv.storage.cachechecks import Part, StoredTensor, checked_layers, mask_bits, payload_pieces
from snapkv.storage.cachemeta import (FORMAT_NAME, FORMAT_VERSION, FORMED_FORMAT_VERSION,  # noqa: F401 (re-exported)
                                      IDENTITY_FIELDS, PLAIN_FORMAT_VERSION, SHARP_FORMAT_VERSION,
                                      SPLIT_FORMAT_VERSION, per_question_of, read_metadata, recorded_sources, tier_of)
from snapkv.storage.deferred import StoredLayers
from snapkv.storage.quantize import Mixed, Quantized, dequantize

SUFFIX = CACHE_SUFFIX
FLOAT16 = str(torch.float16)  # a dtype as StoredTensor names it
EMPTY = np.empty(0, dtype=np.uint8)  # the bytes of an empty tensor


def _payload_pieces(tensors: dict[str, torch.Tensor]) -> list[Piece]:
    """What a digest covers, per tensor in name order: its header (name, dtype, shape) and its bytes (None if empty)."""
    pieces = []
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        header = piece_header(name, tensor.dtype, tensor.shape)
        pieces.append((header, tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else None))
    return pieces


def payload_digest(tensors: dict[str, torch.Tensor], lanes: int = 1) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order, hashed in `lanes` runs at once where
    lanes > 1 (snapkv.base.digests.sha256_of)."""
    return sha256_of(_payload_pieces(tensors), lanes)  # the pieces made before any thread starts


def payload_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """XXH3-128 over what payload_digest covers, in the same order: what a load checks (snapkv.base.digests.checksum_of)."""
    return checksum_of(_payload_pieces(tensors))


def payload_signatures(tensors: dict[str, torch.Tensor]) -> dict:
    """The metadata fields that let a reader check the payload, as save_cache writes them: payload_xxh3_128 (what
    this snapkv checks), payload_sha256_lanes and payload_sha256 (what earlier versions check)."""
    return {"payload_sha256": payload_digest(tensors),
            "payload_sha256_lanes": {"lanes": DIGEST_LANES, "sha256": payload_digest(tensors, DIGEST_LANES)},
            "payload_xxh3_128": payload_checksum(tensors)}


def _pack_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """(kv_heads, kept) positions -> (kv_heads, ceil(length / 8)) uint8 bitmask, low bit first.

    numpy, not torch: a file may be written from a forked process, where torch's thread pool would hang."""
    heads = positions.shape[0]
    mask = np.zeros((heads, length), dtype=bool)
    mask[np.arange(heads)[:, None], positions.cpu().numpy()] = True
    return torch.from_numpy(np.packbits(mask, axis=1, bitorder="little"))


def _unpack_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse: (kv_heads, bytes) uint8 -> (kv_heads, n_set) sorted positions; ValueError when the heads
    keep different numbers of positions."""
    heads = mask.shape[0]
    if (native.unavailable_reason() is None and mask.dtype == torch.uint8 and mask.dim() == 2
            and mask.shape[1] * 8 >= length):
        mask = mask.contiguous()  # snapkv/native/kernels/dequantize.c: a pass to count, a pass to write (~10 us)
        address = native.pointer(mask, torch.uint8)
        count = native.kernels().mask_positions(address, heads, length, mask.shape[1], None, 0)
        positions = torch.empty(heads, max(count, 0), dtype=torch.int64)
        if count < 0 or native.kernels().mask_positions(address, heads, length, mask.shape[1],
                                                        native.pointer(positions, torch.int64), count) != count:
            raise ValueError("heads keep different numbers of positions")
        return positions
    kept = mask_bits(mask.numpy(), length)
    flat = np.flatnonzero(kept).reshape(heads, -1)  # positions in the (heads * length) mask: 4x faster than nonzero()
    return torch.from_numpy(flat - np.arange(heads).reshape(heads, 1) * length)


def _stored_parts(name: str, part) -> dict[str, torch.Tensor]:
    if isinstance(part, Mixed):
        held = part.sharp.shape[1]
        sharp = part.sharp.nonzero()[:, 1].reshape(part.sharp.shape[0], -1)  # (kv_heads, count), ascending
        high = {key.replace(f"{name}.", f"{name}.sharp_"): value
                for key, value in _stored_parts(name, part.high).items()}
        return {f"{name}.sharp_mask": _pack_mask(sharp, held), **high, **_stored_parts(name, part.low)}
    if isinstance(part, Quantized):
        return {f"{name}.codes": part.packed.cpu().contiguous(), f"{name}.scale": part.scale.cpu().contiguous(),
                f"{name}.minimum": part.minimum.cpu().contiguous()}
    return {name: part.detach().cpu().contiguous()}


def cache_tensors(cache: CompressedCache) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors a file holds for `cache` (rounded to its tier's bits if it was not yet), and its storage
    description for the metadata."""
    if cache.payload is None:
        cache = cache.at_precision(cache.tier.bits)
    tensors = {"token_ids": cache.token_ids.to(device="cpu", dtype=torch.int32).contiguous()}
    for index, (positions, (keys, values)) in enumerate(zip(cache.positions, cache.payload)):
        tensors[f"layers.{index}.kept"] = _pack_mask(positions, cache.original_length)
        tensors.update(_stored_parts(f"layers.{index}.keys", keys))
        tensors.update(_stored_parts(f"layers.{index}.values", values))
    keys, values = cache.payload[0]
    storage = {"bits": cache.tier.bits.to_json(), "head_dim": cache.keys[0].shape[-1],
               "kv_heads": cache.keys[0].shape[0]}
    if isinstance(keys, Mixed):
        storage.update(keys=keys.low.scheme.to_dict(), values=values.low.scheme.to_dict(),
                       sharp_keys=keys.high.scheme.to_dict(), sharp_values=values.high.scheme.to_dict())
    else:
        for kind, part in (("keys", keys), ("values", values)):
            if isinstance(part, Quantized):
                storage[kind] = part.scheme.to_dict()
            else:  # a kind in 16 bits: the dtype it is stored in
                storage["dtype"] = str(part.dtype).replace("torch.", "")
    return tensors, storage


def build_metadata(cache: CompressedCache, *, model: dict | None = None, per_question: Cut | None = None,
                   sources: list[Source] = (), system: str | None = None) -> dict:
    """The metadata of a file holding `cache`: everything about the tier comes from the cache itself; `system`: the
    system message it was prompted with, recorded by its digest (what it was measured with: snapkv.storage.measured)."""
    import transformers

    from snapkv import __version__

    bits = cache.tier.bits
    version = (FORMED_FORMAT_VERSION if bits.key_form or bits.value_form
               else SPLIT_FORMAT_VERSION if bits.keys == 16 and bits.values != 16
               else SHARP_FORMAT_VERSION if bits.share else PLAIN_FORMAT_VERSION)
    return {
        "format": FORMAT_NAME,
        "version": f"{version[0]}.{version[1]}",
        "model": model or {},
        "tier": cache.tier.to_dict(),
        "per_question": per_question.to_dict() if per_question else None,
        "mode": mode_of(cache.tier.cut, per_question),
        "document_span": [cache.document.start, cache.document.stop],
        "sources": [asdict(source) for source in sources],
        "original_length": cache.original_length,
        "num_layers": cache.num_layers,
        "producer": {"snapkv": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "created": time.time(),
        **({"system_sha256": text_digest(system)} if system is not None else {}),
    }


def save_cache(path: Path, cache: CompressedCache, *, model: dict | None = None, per_question: Cut | None = None,
               sources: list[Source] = (), system: str | None = None) -> int:
    """Write `cache` to `path` atomically; returns the file's size in bytes.

    model: the identity of the model that made it (LoadedModel.identity); per_question: the cut its
    answers are made with by default; sources: the documents it was made from.
    """
    from safetensors.torch import save_file

    tensors, storage = cache_tensors(cache)
    header = build_metadata(cache, model=model, per_question=per_question, sources=sources, system=system)
    header["storage"] = storage
    header.update(payload_signatures(tensors))
    return write_atomically(
        path, lambda temp: save_file(tensors, str(temp), metadata={"snapkv": json.dumps(header)}), "the cache")


# ---------------------------------------------------------------------------------------------- reading

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


def _check_layer_count(path: Path, layers: int, identity: dict | None) -> None:
    if identity is not None and layers != identity["num_layers"]:
        raise IncompatibleCacheError(f"{path}: has {layers} layers, the model in use has {identity['num_layers']}")


def _check_layer_shape(path: Path, index: int, shape: tuple[int, int, int], identity: dict | None) -> None:
    """A layer's (kv_heads, kept, head_dim) against the model in use (None: no model to check against)."""
    if identity is not None and (shape[0], shape[2]) != (identity["kv_heads"], identity["head_dim"]):
        raise IncompatibleCacheError(f"{path}: layer {index} has {shape[0]} KV heads of size {shape[2]}, "
                                     f"the model in use {identity['kv_heads']} of size {identity['head_dim']}")


def _stored_views(tensors: dict[str, torch.Tensor]) -> dict[str, StoredTensor]:
    """The loaded tensors as snapkv.storage.cachechecks reads them: dtype, shape and bytes (views, no copies)."""
    return {name: StoredTensor(str(tensor.dtype), tuple(tensor.shape),
                               tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else EMPTY)
            for name, tensor in tensors.items()}


def _all_finite(tensors: list[StoredTensor]) -> bool:
    """No NaN or infinity in these float tensors (cachechecks.all_finite, faster): the float16 ones (a quantized file's
    scales and minimums) in one pass in C over their exponent bits where the kernels are available (~0.2 against 3.6
    ms for an 8k-token cache's 240 scale and minimum tensors), the rest by their extremes in PyTorch (NaN propagates
    into them; 6x faster than isfinite().all())."""
    halves = [tensor for tensor in tensors if tensor.dtype == FLOAT16]
    if halves and native.unavailable_reason() is None:
        pointers = (ctypes.c_void_p * len(halves))(*(tensor.data.ctypes.data for tensor in halves))
        counts = (ctypes.c_int64 * len(halves))(*(tensor.nbytes // 2 for tensor in halves))
        if not native.kernels().half_all_finite(pointers, counts, len(halves)):
            return False
        tensors = [tensor for tensor in tensors if tensor.dtype != FLOAT16]
    for tensor in tensors:
        values = torch.from_numpy(tensor.data).view(getattr(torch, tensor.dtype.removeprefix("torch.")))  # (n,)
        if values.numel():
            low, high = torch.aminmax(values)
            if not (torch.isfinite(low) and torch.isfinite(high)):
                return False
    return True


def _built_part(tensors: dict[str, torch.Tensor], part: Part, masks: dict):
    """A checked Part as the cache holds it: the 16-bit (or format 1) tensor, Quantized, or Mixed. masks: the sharper
    masks built so far for this layer, by their bytes: the keys' and values' are the same mask as saved, built once
    and held as one tensor (so that a question's pass can tell they agree without comparing them)."""
    quantized = [Quantized(*(tensors[f"{part.name}.{piece.prefix}{kind}"] for kind in ("codes", "scale", "minimum")),
                           piece.shape, piece.scheme) for piece in part.quantized]
    if not quantized:
        return tensors[part.name]
    if len(quantized) == 1:
        return quantized[0]
    mask = tensors[f"{part.name}.sharp_mask"]
    key = mask.numpy().tobytes()
    if key not in masks:
        masks[key] = torch.from_numpy(mask_bits(mask.numpy(), part.shape[1]))  # (kv_heads, held) bool, as Mixed holds it
    return Mixed(masks[key], *quantized)


def load_cache(path: Path, *, identity: dict | None = None,
               device: torch.device | str | list[torch.device] = "cpu",
               dtype: torch.dtype | None = None, verify: bool = True,
               split: dict | None = None, question_room: int = 0) -> tuple[CompressedCache, dict]:
    """Read and validate a saved cache; refuse (CacheFileError / IncompatibleCacheError) what does not fit.

    identity: the model in use (LoadedModel.identity); None skips the model checks (for `info`).
    device:   one device for every layer, or one per layer (LoadedModel.layer_devices): a file saved
              from any layout loads into any other.
    dtype:    the compute dtype to restore keys and values in (None: as stored; float32 for fewer bits).
    verify:   check the payload's checksum or digest (reads every byte; skip only for very large trusted files).
    split:    a dict that receives where the time went: read_seconds (header and tensors from disk),
              digest_seconds (the checksum or digest), restore_seconds (checks, dequantizing, placing on the devices).
    question_room: for a file of fewer bits than 16 whose layers stay on the CPU in the dtype they are restored
              in: load it deferred (snapkv.storage.deferred: the codes are kept, and each question's pass restores the
              layers one at a time), with this many rows free after each head's positions for the question's
              keys and values (CompressedCache.question_room). 0: restore every layer now.
    """
    from safetensors.torch import load_file

    clock = time.perf_counter()
    path = Path(path)
    metadata = read_metadata(path)
    if identity is not None:
        check_identity(path, metadata, identity)
    tier = tier_of(path, metadata)
    try:
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises its own error type for every structural fault
        raise CacheFileError(f"{path}: damaged cache file ({error})") from error
    read_at = time.perf_counter()
    views = _stored_views(tensors)  # what the checks read: each tensor's dtype, shape and bytes
    if verify:  # by the newest digest the file has (snapkv.base.digests.pieces_match)
        check_payload(path, payload_pieces(views), metadata)
    digest_at = time.perf_counter()
    length, layers = metadata["original_length"], metadata["num_layers"]  # whole numbers from 1 (cacheschema)
    _check_layer_count(path, layers, identity)
    checked = checked_layers(path, views, metadata, _all_finite)  # every check of the tensors
    devices = list(device) if isinstance(device, (list, tuple)) else [device] * layers
    if len(devices) != layers:
        raise IncompatibleCacheError(f"{path}: has {layers} layers, the model in use has {len(devices)}")
    # quantized parts straight into a bf16 model's dtype (one pass, as .to() would round), else fp32
    restore_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    defer = (question_room > 0 and dtype in (None, restore_dtype)
             and all(torch.device(one).type == "cpu" for one in devices))
    format_1 = metadata.get("storage", {}).get("format") == 1  # positions listed; later formats' from bit masks
    found = []  # per layer (keys, values, positions, the stored pair or None), keys and values restored unless deferred
    for index, layer in enumerate(checked):
        _check_layer_shape(path, index, layer.keys.shape, identity)
        masks = {}  # the layer's sharper masks by their bytes
        stored = tuple(_built_part(tensors, part, masks) for part in (layer.keys, layer.values))
        if format_1:
            found.append((*stored, tensors[f"layers.{index}.positions"], None))
            continue
        restored = [part if isinstance(part, torch.Tensor) or defer else dequantize(part, restore_dtype)
                    for part in stored]
        found.append((*restored, _unpack_mask(tensors[f"layers.{index}.kept"], length), stored))
    defer = defer and all(stored is not None and not all(isinstance(part, torch.Tensor) for part in stored)
                          for *_, stored in found)  # layers with a quantized kind are left as stored
    span = metadata.get("document_span")
    if span is not None and not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) for v in span)
                                 and 0 <= span[0] <= span[1] <= length):
        raise CacheFileError(f"{path}: damaged metadata (document span {span!r})")
    if defer:
        keys = StoredLayers([keys for keys, *_ in found], restore_dtype)
        values = StoredLayers([values for _, values, *_ in found], restore_dtype)
    else:  # a part left as stored for a deferred load that cannot be one (16-bit keys beside quantized values)
        def restored(part):
            return part if isinstance(part, torch.Tensor) else dequantize(part, restore_dtype)

        keys = [restored(keys).to(device=devices[i], dtype=dtype) for i, (keys, _, _, _) in enumerate(found)]
        values = [restored(values).to(device=devices[i], dtype=dtype) for i, (_, values, _, _) in enumerate(found)]
    cache = CompressedCache(
        keys=keys,
        values=values,
        positions=[positions.to(device=devices[i], dtype=torch.int64) for i, (_, _, positions, _) in enumerate(found)],
        original_length=length,
        token_ids=tensors["token_ids"].to(torch.int64),
        tier=tier,
        document_span=range(*span) if span is not None else None,
        payload=None if found[0][3] is None else [stored for *_, stored in found],
        question_room=question_room if defer else 0,
    )
    if split is not None:
        split.update(read_seconds=read_at - clock, digest_seconds=digest_at - read_at,
                     restore_seconds=time.perf_counter() - digest_at)
    return cache, metadata
