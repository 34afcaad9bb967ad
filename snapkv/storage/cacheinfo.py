"""What a saved cache holds, told from its header and raw bytes alone: free of torch, so that `snapkv info` answers
at once.

describe_file(path) reads a file as snapkv.storage.cachefile.load_cache does (no model given) and refuses what it refuses,
with the same CacheFileError: the header and metadata (snapkv.storage.cachemeta), the safetensors layout (checked by
safetensors itself), the checksum over the raw tensor bytes (snapkv.base.digests, each piece's header made from the dtype
and shape the file declares), then the tensors by the checks load_cache runs too (snapkv.storage.cachechecks). Its
figures are those of the CompressedCache load_cache returns: per layer the (kv_heads, kept, head_dim) of its keys and
values and the bytes they take as stored, and the full cache's size. What needs a tensor's contents (a mask's set
bits, the finite checks) reads it with numpy; nothing is restored.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from snapkv.base.digests import check_payload
from snapkv.base.errors import CacheFileError
from snapkv.compression.config import Cut, Tier
from snapkv.storage.cachechecks import TORCH_DTYPES, StoredTensor, checked_layers, payload_pieces
from snapkv.storage.cachemeta import metadata_of, per_question_of, read_header, tier_of

@dataclass(frozen=True)
class CacheInfo:
    """What a saved cache holds, with the figures its loaded CompressedCache gives."""

    metadata: dict
    tier: Tier
    per_question: Cut | None
    original_length: int
    layer_shapes: list[tuple[int, int, int]]  # per layer (kv_heads, kept, head_dim) of its keys and values
    layer_bytes: list[int]  # per layer, what its keys and values take as stored (stored_layer_bytes)

    @property
    def kept_per_layer(self) -> list[int]:
        """Positions held per KV head, layer by layer."""
        return [kept for _, kept, _ in self.layer_shapes]

    @property
    def stored_kv_bytes(self) -> int:
        """What the keys and values take as stored (CompressedCache.stored_kv_bytes)."""
        return sum(self.layer_bytes)

    def full_kv_bytes(self, element_size: int) -> int:
        """What the uncompressed cache of the same prompt takes in `element_size` bytes a number (as
        CompressedCache.full_kv_bytes counts it: every layer's keys and values at every prompt position)."""
        per_position = sum(heads * head_dim * element_size * 2 for heads, _, head_dim in self.layer_shapes)
        return per_position * self.original_length


# ---------------------------------------------------------------------------------------------- the file

def describe_file(path: Path) -> CacheInfo:
    """What the cache file at `path` holds, checked as load_cache checks it; CacheFileError (exit code 5) naming the
    file for one it would refuse, with its message."""
    path = Path(path)
    header = read_header(path)
    metadata = metadata_of(path, header)
    tier = tier_of(path, metadata)
    _check_safetensors(path)
    tensors = _stored_tensors(path, header)
    check_payload(path, payload_pieces(tensors), metadata)
    found = checked_layers(path, tensors, metadata)
    return CacheInfo(metadata, tier, per_question_of(path, metadata), metadata["original_length"],
                     [layer.keys.shape for layer in found], [layer.stored for layer in found])


def _check_safetensors(path: Path) -> None:
    """safetensors' own checks of the header (known dtypes, offsets that fit the shapes and cover the file), by the
    library that load_cache reads with, so that a file is refused with its words."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except Exception as error:  # safetensors raises its own error type for every structural fault
        raise CacheFileError(f"{path}: damaged cache file ({error})") from error


def _stored_tensors(path: Path, header: dict) -> dict[str, StoredTensor]:
    """Every tensor of the file by name, its bytes a view of the file mapped into memory (read as they are used)."""
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)  # (file bytes,)
    except (OSError, ValueError) as error:
        raise CacheFileError(f"{path}: cannot read ({error})") from error
    start = 8 + int.from_bytes(mapped[:8].tobytes(), "little")  # the tensors' bytes follow the header
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:  # a dtype safetensors knows and torch does not: load_file refuses it so
            raise CacheFileError(f"{path}: damaged cache file (Dtype not understood: {entry['dtype']})")
        begin, end = entry["data_offsets"]
        tensors[name] = StoredTensor(dtype, tuple(entry["shape"]), mapped[start + begin:start + end])
    return tensors
