"""A GGUF file read as llama.cpp reads it: the header and metadata parsed, every tensor checked against the file, the
tensor data mapped (never copied), each matrix's bytes handed out as a uint8 view of the mapping.

The format (GGUF version 2 and 3, little-endian): "GGUF", version u32, tensor count u64, metadata count u64; the
metadata as (key string, value type u32, value); the tensor infos as (name string, dimension count u32, dimensions
u64 each, innermost first, type u32, offset u64); padding to the alignment (`general.alignment`, 32 when absent);
then the tensor data, each tensor at its offset from there. A string is a u64 length and that many UTF-8 bytes.

Everything read is checked before it is used: a truncated or crafted file (a count or length past the end, offsets
or sizes past the end or overlapping the header, sizes that overflow, an unknown value or tensor type, a duplicate
name) raises ModelFileError saying what is wrong, never reads out of bounds.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from snapkv.base.errors import ModelFileError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMENSIONS = 4
MOST_ENTRIES = 1 << 24  # tensors or metadata entries: more is a crafted count, not a model

# ggml's tensor types: id -> (name, elements per block, bytes per block). Types snapkv does not compute with are
# listed too, so that a file holding them is read and refused by name, not as an unknown number.
TENSOR_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
# the types snapkv multiplies by (snapkv/native/kernels/gguf_blocks.c, dense_rows.c for F32 and BF16)
COMPUTED_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})

# metadata value types: id -> struct format of one scalar (strings and arrays are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file describes it. shape: outermost first, as PyTorch writes it ((rows, columns) for a
    matrix: the file lists (columns, rows)); offset: from the start of the file."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.type_id][0]

    @property
    def row_bytes(self) -> int:
        """The bytes of one row (the innermost dimension)."""
        _, elements, size = TENSOR_TYPES[self.type_id]
        return self.shape[-1] // elements * size


class _Reader:
    """Reads little-endian values from the mapped file, refusing any read past its end."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: not a readable GGUF file: {what}")

    def take(self, size: int, what: str) -> memoryview:
        if size < 0 or self.at + size > len(self.data):
            raise self.fail(f"{what} runs past the end of the file (truncated?)")
        view = memoryview(self.data)[self.at:self.at + size]
        self.at += size
        return view

    def scalar(self, form: str, what: str):
        return struct.unpack(form, self.take(struct.calcsize(form), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        raw = self.take(length, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"{what} is not UTF-8 text") from error

    def strings(self, length: int, what: str) -> "StringArray":
        """An array of strings (a vocabulary: 150k of them), walked to its end and decoded only when read."""
        start, end, at = self.at, len(self.data), self.at
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(length):
            if at + 8 > end:
                raise self.fail(f"{what} runs past the end of the file (truncated?)")
            at += 8 + unpack(self.data, at)[0]
        if at > end:
            raise self.fail(f"{what} runs past the end of the file (truncated?)")
        self.at = at
        return StringArray(self.data, start, length)

    def count(self, what: str) -> int:
        value = self.scalar("<Q", what)
        if value > MOST_ENTRIES and what.endswith("count"):
            raise self.fail(f"{what} {value} is not a model's")
        return value

    def value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY and depth == 0:
            item_kind, length = self.scalar("<I", what), self.scalar("<Q", what)
            if item_kind in _SCALARS:  # read at once, bounds checked first
                form = _SCALARS[item_kind]
                size = struct.calcsize(form)
                if length > (len(self.data) - self.at) // size:
                    raise self.fail(f"{what}: an array of {length} values runs past the end of the file")
                return list(struct.unpack(f"<{length}{form[1]}", self.take(length * size, what)))
            if item_kind != _STRING and item_kind != _ARRAY:
                raise self.fail(f"{what}: unknown array item type {item_kind}")
            if length > len(self.data) - self.at:  # every item takes at least a byte
                raise self.fail(f"{what}: an array of {length} items runs past the end of the file")
            if item_kind == _STRING:
                return self.strings(length, what)
            return [self.value(item_kind, what, depth + 1) for _ in range(length)]
        raise self.fail(f"{what}: unknown value type {kind}")


class StringArray:
    """A metadata array of strings, left in the mapping until read (list(it), len(it))."""

    def __init__(self, data: mmap.mmap, start: int, length: int) -> None:
        self._data, self._start, self._length = data, start, length

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        at, unpack = self._start, struct.Struct("<Q").unpack_from
        for _ in range(self._length):
            size = unpack(self._data, at)[0]
            yield bytes(self._data[at + 8:at + 8 + size]).decode("utf-8", errors="replace")
            at += 8 + size


class GGUFFile:
    """A GGUF file, mapped: `metadata` (key -> value), `tensors` (name -> TensorInfo), and `tensor_bytes(name)`, a
    uint8 view of a tensor's data in the mapping (rows, row bytes). Raises ModelFileError for a file it cannot
    read."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                # a private mapping, so PyTorch gets a writable buffer; the pages are the file's until written,
                # and nothing writes them
                self._data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
            raise ModelFileError(f"{self.path}: cannot be read as a GGUF file ({error})") from error
        reader = _Reader(self._data, self.path)
        if bytes(reader.take(4, "the header")) != MAGIC:
            raise reader.fail("it does not start with GGUF")
        self.version = reader.scalar("<I", "the version")
        if self.version not in VERSIONS:
            raise reader.fail(f"GGUF version {self.version} (snapkv reads versions 2 and 3)")
        tensor_count = reader.count("the tensor count")
        metadata_count = reader.count("the metadata count")
        self.metadata: dict[str, object] = {}
        for index in range(metadata_count):
            key = reader.string(f"metadata key {index}")
            self.metadata[key] = reader.value(reader.scalar("<I", f"the type of {key}"), key)
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise reader.fail(f"general.alignment {alignment!r} is not a power of two")
        described = [self._tensor_info(reader, index) for index in range(tensor_count)]
        data_start = -(-reader.at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, type_id, shape, offset in described:
            if name in self.tensors:
                raise reader.fail(f"tensor {name} is listed twice")
            if offset % alignment:
                raise reader.fail(f"tensor {name}'s offset {offset} is not aligned to {alignment}")
            _, elements, size = TENSOR_TYPES[type_id]
            nbytes = _count(shape) // elements * size
            start = data_start + offset
            if start + nbytes > len(self._data):
                raise reader.fail(f"tensor {name} ({nbytes} bytes at {start}) runs past the end of the file "
                                  f"({len(self._data)} bytes): truncated?")
            self.tensors[name] = TensorInfo(name, type_id, shape, start, nbytes)

    @staticmethod
    def _tensor_info(reader: _Reader, index: int) -> tuple[str, int, tuple[int, ...], int]:
        name = reader.string(f"tensor {index}'s name")
        dimensions = reader.scalar("<I", f"tensor {name}'s dimension count")
        if not 1 <= dimensions <= MAX_DIMENSIONS:
            raise reader.fail(f"tensor {name} has {dimensions} dimensions")
        sizes = [reader.scalar("<Q", f"tensor {name}'s dimensions") for _ in range(dimensions)]
        type_id = reader.scalar("<I", f"tensor {name}'s type")
        offset = reader.scalar("<Q", f"tensor {name}'s offset")
        if type_id not in TENSOR_TYPES:
            raise reader.fail(f"tensor {name} has an unknown type {type_id}")
        _, elements, _ = TENSOR_TYPES[type_id]
        if any(size < 1 for size in sizes) or _count(sizes) > len(reader.data) * 8:
            raise reader.fail(f"tensor {name}'s dimensions {sizes} cannot fit in this file")
        if sizes[0] % elements:
            raise reader.fail(f"tensor {name}'s rows of {sizes[0]} are not whole blocks of {elements}")
        return name, type_id, tuple(reversed(sizes)), offset

    def tensor_bytes(self, name: str):
        """The tensor's data as a uint8 view of the mapping (a torch.Tensor), (rows, row bytes) with rows every outer
        dimension. torch is imported here, not with the module: `snapkv models` reads metadata without it."""
        import torch

        info = self.tensors[name]
        flat = torch.frombuffer(self._data, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return flat.view(-1, info.row_bytes)

    def tensor_values(self, name: str):
        """A small F32, F16 or BF16 tensor (a norm, a bias) as fp32 values (a torch.Tensor), a copy, in its shape."""
        import torch

        info = self.tensors[name]
        dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        if info.type_name not in dtypes:
            raise ModelFileError(f"{self.path}: tensor {name} is {info.type_name}, where snapkv expects a float "
                                 "tensor (F32, F16 or BF16)")
        flat = torch.frombuffer(self._data, dtype=dtypes[info.type_name], count=_count(info.shape),
                                offset=info.offset)
        return flat.float().reshape(info.shape).clone()

    @property
    def size(self) -> int:
        return len(self._data)


def _count(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total
