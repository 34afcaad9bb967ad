"""A GGUF file read as llama.cpp reads it (snapkv.modeling.gguf_file): what a sound file holds, mapped, and every kind of
damaged or crafted file refused with a ModelFileError that says what is wrong, never a crash or a read past the end."""

import struct

import pytest
import torch
from gguf_samples import _string, gguf_bytes

from snapkv.base.errors import ModelFileError
from snapkv.modeling.gguf_file import GGUFFile

F32, Q8_0, Q4_K = 0, 8, 12


def _sound() -> tuple[bytes, torch.Tensor, bytes]:
    """A file with a 2 x 3 F32 matrix and a Q8_0 row of 32 weights, its values and the block's bytes."""
    matrix = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    block = struct.pack("<e", 0.5) + bytes(range(32))
    data = matrix.numpy().tobytes() + b"\0" * 8 + block  # the block at offset 32 (aligned)
    tensors = [("m.weight", (3, 2), F32, 0), ("q.weight", (32, 1), Q8_0, 32)]
    return gguf_bytes(tensors, data), matrix, block


def _read(tmp_path, content: bytes) -> GGUFFile:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return GGUFFile(path)


def test_a_sound_file_gives_its_metadata_shapes_and_bytes_in_place(tmp_path):
    content, matrix, block = _sound()
    file = _read(tmp_path, content)
    assert file.version == 3 and file.metadata == {"general.architecture": "llama"}
    assert file.tensors["m.weight"].shape == (2, 3) and file.tensors["q.weight"].shape == (1, 32)
    assert torch.equal(file.tensor_values("m.weight"), matrix)
    assert bytes(file.tensor_bytes("q.weight").numpy().tobytes()) == block
    assert file.tensors["q.weight"].type_name == "Q8_0" and file.tensors["q.weight"].row_bytes == 34


def test_metadata_of_every_value_type_and_arrays_are_read(tmp_path):
    entries = [("a.u8", 0, struct.pack("<B", 7)), ("a.i32", 5, struct.pack("<i", -3)), ("a.f32", 6, struct.pack("<f", 1.5)),
               ("a.bool", 7, struct.pack("<?", True)), ("a.u64", 10, struct.pack("<Q", 2**40)),
               ("a.f64", 12, struct.pack("<d", 0.25)),
               ("a.ints", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, 2, 3)),
               ("a.words", 9, struct.pack("<IQ", 8, 2) + _string("one") + _string("two"))]
    metadata = b"".join(_string(key) + struct.pack("<I", kind) + value for key, kind, value in entries)
    file = _read(tmp_path, gguf_bytes([], b"", metadata=metadata, metadata_count=len(entries)))
    assert {key: value for key, value in file.metadata.items() if key != "a.words"} == {
        "a.u8": 7, "a.i32": -3, "a.f32": 1.5, "a.bool": True, "a.u64": 2**40, "a.f64": 0.25, "a.ints": [1, 2, 3]}
    assert list(file.metadata["a.words"]) == ["one", "two"] and len(file.metadata["a.words"]) == 2


def test_a_file_cut_anywhere_is_refused_as_truncated(tmp_path):
    content, _, _ = _sound()
    for end in (0, 3, 10, 30, 60, 90, len(content) - 40, len(content) - 1):
        with pytest.raises(ModelFileError, match="GGUF|truncated|read"):
            _read(tmp_path, content[:end])


@pytest.mark.parametrize("change, message", [
    (dict(magic=b"GGML"), "does not start with GGUF"),
    (dict(version=1), "version 1"),
    (dict(version=4), "version 4"),
    (dict(tensor_count=2**40), "tensor count"),
    (dict(metadata_count=2**40, metadata=b""), "metadata count"),
    (dict(metadata=_string("x") + struct.pack("<I", 13) + b"\0" * 8, metadata_count=1), "unknown value type 13"),
    (dict(metadata=_string("x") + struct.pack("<I", 9) + struct.pack("<IQ", 0, 2**50), metadata_count=1),
     "runs past the end"),
    (dict(metadata=struct.pack("<Q", 2**62), metadata_count=1), "runs past the end"),
])
def test_a_crafted_header_is_refused_with_what_is_wrong(tmp_path, change, message):
    content = gguf_bytes([("m.weight", (3, 2), F32, 0)], b"\0" * 24, **change)
    with pytest.raises(ModelFileError, match=message):
        _read(tmp_path, content)


@pytest.mark.parametrize("tensor, message", [
    (("m.weight", (3, 2), 99, 0), "unknown type 99"),
    (("m.weight", (3, 2), F32, 2**60), "runs past the end"),
    (("m.weight", (3, 2), F32, 7), "not aligned"),
    (("m.weight", (2**62, 2**62), F32, 0), "cannot fit"),
    (("m.weight", (0, 2), F32, 0), "cannot fit"),
    (("m.weight", (), F32, 0), "0 dimensions"),
    (("m.weight", (1, 1, 1, 1, 1), F32, 0), "5 dimensions"),
    (("m.weight", (100, 1), Q4_K, 0), "not whole blocks"),
    (("m.weight", (256, 2), Q4_K, 0), "runs past the end"),
])
def test_a_crafted_tensor_is_refused_with_what_is_wrong(tmp_path, tensor, message):
    with pytest.raises(ModelFileError, match=message):
        _read(tmp_path, gguf_bytes([tensor], b"\0" * 64))


def test_a_tensor_named_twice_is_refused(tmp_path):
    content = gguf_bytes([("m.weight", (4,), F32, 0), ("m.weight", (4,), F32, 32)], b"\0" * 64)
    with pytest.raises(ModelFileError, match="listed twice"):
        _read(tmp_path, content)


def test_an_empty_file_and_a_folder_are_refused(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError):
        GGUFFile(tmp_path / "empty.gguf")
    with pytest.raises(ModelFileError):
        GGUFFile(tmp_path)
