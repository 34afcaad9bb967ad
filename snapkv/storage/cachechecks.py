"""The checks of a saved cache's tensors, one set for both readers: snapkv.storage.cachefile.load_cache (torch, for
answering) and snapkv.storage.cacheinfo.describe_file (numpy only, for `snapkv info`). Free of torch.

Each reader hands checked_layers the file's tensors as StoredTensors (a dtype as torch names it, a shape, the raw
bytes) and its metadata; checked_layers checks the prompt ids, the tensors' names, dtypes and shapes against the
layout the metadata gives, the kept-position masks, the positions and that no stored value is NaN or infinite, and
returns each layer as the file stores it (Layer: its keys' and values' Parts, with the names and schemes of their
tensors), from which load_cache builds its tensors without checking anything again. A file either reader refuses
is refused by both, with the same CacheFileError.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from snapkv.base.bits import Bits, Scheme
from snapkv.base.digests import Piece, piece_header
from snapkv.base.errors import CacheFileError
from snapkv.storage.cachemeta import storage_scheme, stored_layout, stored_tensor_names
from snapkv.storage.cacheschema import MAX_VOCABULARY

# safetensors' dtype codes, as torch names the dtypes they load as: what a digest covers and load_cache's messages say
TORCH_DTYPES = {
    "BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8", "I16": "torch.int16", "U16": "torch.uint16",
    "F16": "torch.float16", "BF16": "torch.bfloat16", "I32": "torch.int32", "U32": "torch.uint32",
    "F32": "torch.float32", "F64": "torch.float64", "I64": "torch.int64", "U64": "torch.uint64",
    "C64": "torch.complex64", "F8_E5M2": "torch.float8_e5m2", "F8_E4M3": "torch.float8_e4m3fn",
    "F8_E8M0": "torch.float8_e8m0fnu", "F8_E4M3FNUZ": "torch.float8_e4m3fnuz", "F8_E5M2FNUZ": "torch.float8_e5m2fnuz",
    "F4": "torch.float4_e2m1fn_x2",
}
UINT8, FLOAT16, BFLOAT16, FLOAT32 = "torch.uint8", "torch.float16", "torch.bfloat16", "torch.float32"
SIXTEEN_BITS = (FLOAT16, BFLOAT16)  # what a kind stored in 16 bits may be
PLAIN_FLOATS = (FLOAT16, BFLOAT16, FLOAT32)  # format 1's keys and values, in the model's dtype
WHOLE_NUMBERS = {"torch.int32": "<i4", "torch.int64": "<i8"}  # prompt ids and format 1's positions, as numpy reads them
EXPONENT_BITS = {FLOAT16: 0x7C00, BFLOAT16: 0x7F80}  # all set in a 16-bit float that is infinite or NaN


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a file as it lies there: its dtype as torch names it, its shape, and its raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # (nbytes,) uint8, a view of the mapped file

    @property
    def nbytes(self) -> int:
        return self.data.size

    def values(self, dtype: str) -> np.ndarray:
        """The bytes read as numpy's `dtype` (of this tensor's width, little-endian), in the tensor's shape."""
        return self.data.view(dtype).reshape(self.shape)


@dataclass(frozen=True)
class Quantization:
    """One quantized tensor of a part: its tensors' names are the part's name + "." + prefix + codes / scale /
    minimum; restored to `shape` (kv_heads, rows, head_dim) by `scheme`."""

    prefix: str  # "" or "sharp_"
    scheme: Scheme
    shape: tuple[int, int, int]


@dataclass(frozen=True)
class Part:
    """A layer's keys or values as a file stores them: checked, described, and named for the reader to build.

    name:   the tensors' name ("layers.3.keys"): the tensor itself where plain
    shape:  the shape load_cache gives them: a plain tensor's own (16 bits, or format 1's floats), else the
            (kv_heads, kept, head_dim) they are restored to
    stored: the bytes they take as stored (a sharper share's mask included, as Mixed.nbytes counts it)
    plain:  the tensors stored as floats, checked finite with their layer
    scales: the quantized tensors' scales and minimums, checked finite for all layers first
    quantized: none for a plain part; one Quantization; or a sharper share's then the rest's (the share's rows named
            by the bit mask name + ".sharp_mask")
    """

    name: str
    shape: tuple[int, ...]
    stored: int
    plain: tuple[StoredTensor, ...] = ()
    scales: tuple[StoredTensor, ...] = ()
    quantized: tuple[Quantization, ...] = ()


@dataclass(frozen=True)
class Layer:
    """One layer as a file stores it: its keys and values, and the shape of its positions, (kv_heads, kept).
    positions: format 1's listed positions, checked ascending and within the prompt; None for a mask's, which are."""

    keys: Part
    values: Part
    kept: tuple[int, ...]
    positions: StoredTensor | None = None

    @property
    def stored(self) -> int:
        """What its keys and values take as stored (CompressedCache.stored_layer_bytes)."""
        return self.keys.stored + self.values.stored


def payload_pieces(tensors: dict[str, StoredTensor]) -> list[Piece]:
    """What the file's digest covers, as snapkv.storage.cachefile hashes the tensors it saves: per tensor in name order,
    its header (name, dtype, shape), then its bytes (None if empty)."""
    return [(piece_header(name, tensor.dtype, tensor.shape), tensor.data if tensor.nbytes else None)
            for name, tensor in sorted(tensors.items())]


FiniteCheck = Callable[[list[StoredTensor]], bool]  # whether every value of these float tensors is finite


def all_finite(tensors: list[StoredTensor]) -> bool:
    """No NaN or infinity in any of these float tensors, by numpy (load_cache passes a faster check of its own)."""
    return all(_all_finite(tensor) for tensor in tensors)


def checked_layers(path: Path, tensors: dict[str, StoredTensor], metadata: dict,
                   finite: FiniteCheck = all_finite) -> list[Layer]:
    """Every check of a file's tensors, its metadata already checked (snapkv.storage.cachemeta): the prompt ids, then
    per layer its tensors' names, dtypes and shapes for the layout the metadata gives (format 1 or later), its kept
    positions, its scales and plain values finite. The layers as stored; CacheFileError naming the first fault."""
    length, layers = metadata["original_length"], metadata["num_layers"]  # whole numbers from 1 (cacheschema)
    _check_prompt(path, tensors.get("token_ids"), length)
    if metadata.get("storage", {}).get("format") == 1:
        found = _layers_format_1(path, tensors, layers)
    else:
        found = _layers_format_2(path, tensors, metadata, length, layers, finite)
    for index, layer in enumerate(found):
        _check_layer(path, index, layer, length, finite)
    return found


def _check_prompt(path: Path, ids: StoredTensor | None, length: int) -> None:
    """The prompt's ids: `length` whole numbers, each within any vocabulary."""
    if ids is None or ids.shape != (length,) or ids.dtype not in WHOLE_NUMBERS:
        raise CacheFileError(f"{path}: damaged cache (prompt ids do not match its length)")
    values = ids.values(WHOLE_NUMBERS[ids.dtype])  # (length,)
    if int(values.min()) < 0 or int(values.max()) >= MAX_VOCABULARY:
        raise CacheFileError(f"{path}: damaged cache (prompt ids outside any vocabulary)")


# ---------------------------------------------------------------------------------------------- layers

def _layers_format_1(path: Path, tensors: dict[str, StoredTensor], layers: int) -> list[Layer]:
    """The layers of a format 1 file: keys, values and positions as plain tensors."""
    if set(tensors) != stored_tensor_names(layers, None):
        raise CacheFileError(f"{path}: damaged cache (tensors missing or unexpected)")
    found = []
    for index in range(layers):
        keys, values, positions = (tensors[f"layers.{index}.{part}"] for part in ("keys", "values", "positions"))
        if {keys.dtype, values.dtype} - set(PLAIN_FLOATS) or positions.dtype not in WHOLE_NUMBERS:
            raise CacheFileError(f"{path}: damaged cache (layer {index} stored as {keys.dtype}, {values.dtype}, "
                                 f"{positions.dtype})")
        found.append(Layer(_plain(f"layers.{index}.keys", keys), _plain(f"layers.{index}.values", values),
                           positions.shape, positions))
    return found


def _layers_format_2(path: Path, tensors: dict[str, StoredTensor], metadata: dict, length: int,
                     layers: int, finite: FiniteCheck) -> list[Layer]:
    """The layers of a later file: each a kept-positions mask, and its keys and values in their bits."""
    storage = metadata.get("storage") or {}
    bits, head_dim, kv_heads = stored_layout(path, metadata, tensors, layers)
    found = []
    for index in range(layers):
        kept = _counted(path, tensors[f"layers.{index}.kept"], kv_heads, length, f"layer {index}",
                        "kept-positions mask")
        shape = (kv_heads, kept, head_dim)
        keys, values = (_stored_part(path, tensors, f"layers.{index}.{kind}", shape, storage, kind, bits)
                        for kind in ("keys", "values"))
        found.append(Layer(keys, values, (kv_heads, kept)))
    _check_finite_scales(path, found, finite)
    return found


def _plain(name: str, tensor: StoredTensor) -> Part:
    """Keys or values stored as floats, in the shape they have."""
    return Part(name, tensor.shape, tensor.nbytes, plain=(tensor,))


def _stored_part(path: Path, tensors: dict[str, StoredTensor], name: str, shape: tuple[int, int, int],
                 storage: dict, kind: str, bits: Bits) -> Part:
    """A layer's keys or values (`kind`, restored to `shape`: (kv_heads, kept, head_dim)) as stored: a 16-bit tensor,
    a quantized one, or a sharper share and the rest, each quantized."""
    if (bits.keys if kind == "keys" else bits.values) == 16:
        part = tensors[name]
        if part.dtype not in SIXTEEN_BITS:
            raise CacheFileError(f"{path}: damaged cache ({name} is {part.dtype}, not 16-bit)")
        return _plain(name, part)
    if not bits.share:
        return _quantized_part(path, tensors, name, "", shape, storage, kind)
    heads, held, head_dim = shape
    mask = tensors[f"{name}.sharp_mask"]
    count = _counted(path, mask, heads, held, name, "sharper mask")
    high = _quantized_part(path, tensors, name, "sharp_", (heads, count, head_dim), storage, f"sharp_{kind}")
    low = _quantized_part(path, tensors, name, "", (heads, held - count, head_dim), storage, kind)
    return Part(name, shape, high.stored + low.stored + mask.nbytes, scales=high.scales + low.scales,
                quantized=high.quantized + low.quantized)


def _quantized_part(path: Path, tensors: dict[str, StoredTensor], name: str, prefix: str,
                    shape: tuple[int, int, int], storage: dict, kind: str) -> Part:
    """One quantized tensor of `shape` (`name` + .codes, .scale and .minimum, or .sharp_codes etc.), its parts'
    shapes checked against the scheme the storage gives `kind`."""
    scheme = storage_scheme(path, storage, kind)
    codes, scale, minimum = (tensors[f"{name}.{prefix}{part}"] for part in ("codes", "scale", "minimum"))
    codes_shape, scale_shape = scheme.stored_shapes(shape)
    if (codes.dtype != UINT8 or codes.shape != codes_shape or scale.shape != scale_shape
            or minimum.shape != scale_shape or scale.dtype != FLOAT16 or minimum.dtype != FLOAT16):
        raise CacheFileError(f"{path}: damaged cache ({name}: shapes {codes.shape}, {scale.shape}, "
                             f"{minimum.shape} do not fit {shape} at {scheme.bits} bits)")
    return Part(name, shape, codes.nbytes + scale.nbytes + minimum.nbytes, scales=(scale, minimum),
                quantized=(Quantization(prefix, scheme, shape),))


def _counted(path: Path, mask: StoredTensor, heads: int, length: int, owner: str, kind: str) -> int:
    """The positions each head keeps by a (heads, ceil(length / 8)) bit mask, its dtype and shape checked;
    CacheFileError naming `owner` (a layer, a tensor) and the mask's `kind` otherwise."""
    if mask.dtype != UINT8 or mask.shape != (heads, (length + 7) // 8):
        raise CacheFileError(f"{path}: damaged cache ({owner} {kind} {mask.shape})")
    try:
        return _kept_per_head(mask, length)
    except ValueError as error:
        raise CacheFileError(f"{path}: damaged cache ({owner}: {error})") from error


def _kept_per_head(mask: StoredTensor, length: int) -> int:
    """How many of `length` positions each head keeps (mask_bits); ValueError when the heads keep different numbers."""
    kept = mask_bits(mask.values("u1"), length)  # (kv_heads, length)
    return int(np.count_nonzero(kept[0])) if kept.shape[0] else 0


def mask_bits(mask: np.ndarray, length: int) -> np.ndarray:
    """(kv_heads, ceil(length / 8)) uint8, bit p % 8 of byte p // 8 set where position p is kept -> (kv_heads, length)
    bool, True where kept; ValueError when the heads keep different numbers of positions."""
    kept = np.unpackbits(mask, axis=1, count=length, bitorder="little").view(bool)
    counts = np.count_nonzero(kept, axis=1)  # (kv_heads,)
    if counts.size and (counts != counts[0]).any():
        raise ValueError("heads keep different numbers of positions")
    return kept


# ---------------------------------------------------------------------------------------------- checks

def _check_finite_scales(path: Path, layers: list[Layer], finite: FiniteCheck) -> None:
    """Every quantized part's scales and minimums finite (so that restored values are: snapkv.storage.quantize), checked
    for all layers at once (one pass), then layer by layer only to name the first that holds one that is not."""
    every = [tensor for layer in layers for tensor in layer.keys.scales + layer.values.scales]
    if not every or finite(every):
        return
    for index, layer in enumerate(layers):
        if not finite(list(layer.keys.scales + layer.values.scales)):
            raise CacheFileError(f"{path}: damaged cache (layer {index} holds NaN or infinite values)")


def _check_layer(path: Path, index: int, layer: Layer, length: int, finite: FiniteCheck) -> None:
    """A layer's keys and values of one shape, (kv_heads, kept, head_dim), as many positions as it keeps (at least
    one: the template around the document is always kept), format 1's positions ascending within the prompt, and its
    plain tensors finite."""
    key_shape, value_shape = layer.keys.shape, layer.values.shape
    if len(key_shape) != 3 or key_shape != value_shape or layer.kept != key_shape[:2]:
        raise CacheFileError(f"{path}: damaged cache (layer {index} shapes {key_shape}, {value_shape}, {layer.kept})")
    if key_shape[1] == 0:
        raise CacheFileError(f"{path}: damaged cache (layer {index} keeps no positions)")
    if layer.positions is not None and not _ascending_within(layer.positions, length):
        raise CacheFileError(f"{path}: damaged cache (layer {index} positions out of order or range)")
    if not finite(list(layer.keys.plain + layer.values.plain)):
        raise CacheFileError(f"{path}: damaged cache (layer {index} holds NaN or infinite values)")


def _ascending_within(positions: StoredTensor, length: int) -> bool:
    """Each head's listed positions strictly ascending, in [0, length)."""
    listed = positions.values(WHOLE_NUMBERS[positions.dtype])  # (kv_heads, kept)
    return not listed.size or bool(listed.min() >= 0 and listed.max() < length
                                   and (listed[:, 1:] > listed[:, :-1]).all())


def _all_finite(tensor: StoredTensor) -> bool:
    """No NaN or infinity: a 16-bit float's exponent bits are never all set; float32 through numpy."""
    if tensor.dtype == FLOAT32:
        return bool(np.isfinite(tensor.values("<f4")).all())
    exponent = EXPONENT_BITS[tensor.dtype]
    return not bool(((tensor.values("<u2") & exponent) == exponent).any())
