"""`snapkv info` reads a cache without torch (snapkv.storage.cacheinfo): the same figures as a load gives, the same refusals
with the same messages, the checksum checked over the raw bytes, and a document given said to match or not."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import VOCAB, build_tiny
from snapkv.storage.cacheinfo import describe_file
from snapkv.storage.cachefile import load_cache, payload_digest, payload_signatures, per_question_of, read_metadata, save_cache
from snapkv.compression.config import Cut, SnapKVConfig
from snapkv.io.documents import Document, read_sources
from snapkv.base.errors import CacheFileError
from snapkv.engine.generation import prefill
from snapkv.session import Session

LEDGER = Document(" ".join(f"Line {i} of the ledger holds {i * 3}." for i in range(20)))

# The tiers a file is written in: (name, settings); budget 32 and window 8 unless given.
TIERS = [
    ("16", dict(store_bits=16)),
    ("16/8", dict(store_bits="16/8")),
    ("8", dict(store_bits=8)),
    ("4/3 of half the document", dict(store_bits="4/3", store_keep=0.5)),
    ("3/2+20%@8/4", dict(store_bits="3/2+20%@8/4")),
    ("document-window", dict(query_aware=False)),
    ("reconstruction tier", dict(store_keep=0.6, store_method="reconstruction", store_bits=4)),
    ("prompt fits the budget", dict(budget=4096, query_aware=False)),
]


def saved(loaded, folder: Path, name: str = "saved", **settings) -> Path:
    """The ledger's cache as a Session makes and saves it with these settings."""
    session = Session(loaded, SnapKVConfig(**{"budget": 32, "window": 8, **settings}))
    path = folder / f"{name}.snapkv"
    session.save(session.prepare(LEDGER), path)
    return path


def torch_figures(path: Path) -> dict:
    """What `snapkv info` showed of a file when it loaded it with torch."""
    cache, metadata = load_cache(path)
    per_question = per_question_of(path, metadata)
    return {"kv_bytes": cache.stored_kv_bytes, "kv_bytes_full": cache.full_kv_bytes(2),
            "kept_per_layer": [k.shape[1] for k in cache.keys], "bytes_per_layer": cache.stored_layer_bytes(),
            "held": cache.tier.describe(),
            "answered_with": per_question.describe() if per_question else "the cache as it is"}


def header_figures(path: Path) -> dict:
    """The same, told by snapkv.storage.cacheinfo from the file's header and raw bytes."""
    described = describe_file(path)
    return {"kv_bytes": described.stored_kv_bytes, "kv_bytes_full": described.full_kv_bytes(2),
            "kept_per_layer": described.kept_per_layer, "bytes_per_layer": described.layer_bytes,
            "held": described.tier.describe(),
            "answered_with": described.per_question.describe() if described.per_question else "the cache as it is"}


def refusal(read, path: Path) -> str | None:
    """The message `read` refuses the file with (None: it reads it)."""
    try:
        read(path)
    except CacheFileError as error:
        return str(error)
    return None


def without_torch(*argv: str, home: Path) -> subprocess.CompletedProcess:
    """`python -m snapkv_cli ARGV` in a child that reports every module it imports (-X importtime, on stderr)."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "snapkv_cli", *argv], capture_output=True,
                          text=True, timeout=120,
                          env={"SNAPKV_HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                               "SNAPKV_NOLOG": "1", "COLUMNS": "200"})


def heavy_imports(result: subprocess.CompletedProcess) -> list[str]:
    """torch or transformers modules the child imported."""
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    return sorted({module for module in modules if module.split(".")[0] in ("torch", "transformers")})


def messages(result: subprocess.CompletedProcess) -> str:
    """The child's stderr without its import times."""
    return "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))


# ---------------------------------------------------------------------------------------------- the figures

@pytest.mark.parametrize("settings", [settings for _, settings in TIERS], ids=[name for name, _ in TIERS])
def test_the_figures_are_those_a_load_gives(tiny_loaded, tmp_path, settings):
    path = saved(tiny_loaded, tmp_path, **settings)
    assert header_figures(path) == torch_figures(path)


def test_a_bf16_file_and_a_format_1_file_give_the_same_figures(tmp_path):
    model = build_tiny("llama-gqa")
    cache = prefill(model, torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(3)), Cut(24, 8))
    in_bf16 = cache.to("cpu", torch.bfloat16)
    save_cache(tmp_path / "bf16.snapkv", in_bf16)
    assert read_metadata(tmp_path / "bf16.snapkv")["storage"]["dtype"] == "bfloat16"
    assert header_figures(tmp_path / "bf16.snapkv") == torch_figures(tmp_path / "bf16.snapkv")
    path = format_1_file(cache, tmp_path)
    assert header_figures(path) == torch_figures(path)


def format_1_file(cache, folder: Path, positions_dtype=torch.int32, keys_dtype=torch.float32,
                  positions_change=None) -> Path:
    """`cache` as snapkv 0.1 wrote it (format 1.0: listed positions, plain tensors in the model's dtype)."""
    tensors = {"token_ids": cache.token_ids.to(torch.int32)}
    for index, (keys, values, positions) in enumerate(zip(cache.keys, cache.values, cache.positions)):
        positions = positions_change(positions) if positions_change and index == 1 else positions
        tensors.update({f"layers.{index}.keys": keys.to(keys_dtype), f"layers.{index}.values": values,
                        f"layers.{index}.positions": positions.to(positions_dtype).contiguous()})
    metadata = {"format": "snapkv-cache", "version": "1.0", "model": {}, "mode": "document-window",
                "stored": {"budget": 24, "window": 8, "kernel": 15, "pooling": "max"}, "settings": {},
                "original_length": cache.original_length, "num_layers": cache.num_layers, "dtype": "float32",
                "sources": [], "payload_sha256": payload_digest(tensors)}
    path = folder / "old.snapkv"
    save_file(tensors, str(path), metadata={"snapkv": json.dumps(metadata)})
    return path


# ---------------------------------------------------------------------------------------------- refusals

def signed_copy(path: Path, folder: Path, damage) -> Path:
    """The file with its tensors changed by `damage` and every digest recomputed: what is refused is the damage."""
    tensors = load_file(str(path))
    damage(tensors)
    metadata = {**read_metadata(path), **payload_signatures(tensors)}
    out = folder / "damaged.snapkv"
    save_file(tensors, str(out), metadata={"snapkv": json.dumps(metadata)})
    return out


def _set(name: str, value):
    return lambda tensors: tensors[name].fill_(value)


def _cut(name: str, index):
    return lambda tensors: tensors.__setitem__(name, tensors[name][index].clone())


def _retyped(name: str, dtype):
    return lambda tensors: tensors.__setitem__(name, tensors[name].to(dtype))


def _nothing_kept(tensors):
    for part in ("keys", "values"):
        tensors[f"layers.0.{part}"] = tensors[f"layers.0.{part}"][:, :0].contiguous()
    tensors["layers.0.kept"] = torch.zeros_like(tensors["layers.0.kept"])


def _negative_id(tensors):
    tensors["token_ids"] = tensors["token_ids"].clone()
    tensors["token_ids"][3] = -1


DAMAGE = {  # name: (the tier it is done to, the damage, a word of the message)
    "codes cut short": (dict(store_bits=4, store_keep=0.5), _cut("layers.1.keys.codes", (slice(None), slice(None),
                                                                                           slice(0, 1))), "do not fit"),
    "scale is NaN": (dict(store_bits=4, store_keep=0.5), _set("layers.0.values.scale", float("nan")), "NaN"),
    "heads keep different counts": (dict(store_bits=8, store_keep=0.5), lambda t: t["layers.2.kept"][0].fill_(255), "different"),
    "kept mask of another length": (dict(store_bits=8), _cut("layers.1.kept", (slice(None), slice(0, 2))), "mask"),
    "heads share differently": (dict(store_bits="4/2+20%@4"), lambda t: t["layers.1.values.sharp_mask"][0].fill_(255),
                                "different"),
    "sharp codes cut short": (dict(store_bits="4/2+20%@4"), _cut("layers.0.keys.sharp_codes", (slice(None), slice(0, 1))),
                              "do not fit"),
    "sharp scale is infinite": (dict(store_bits="4/2+20%@4"), _set("layers.2.keys.sharp_scale", float("inf")),
                                "infinite"),
    "sharp part missing": (dict(store_bits="4/2+20%@4"), lambda t: t.pop("layers.0.values.sharp_minimum"), "missing"),
    "16-bit keys are NaN": (dict(store_bits=16), _set("layers.1.keys", float("nan")), "NaN"),
    "16-bit keys stored in 32": (dict(store_bits=16), _retyped("layers.1.keys", torch.float32), "not 16-bit"),
    "keys and values of two shapes": (dict(store_bits=16), _cut("layers.2.values", (slice(None), slice(None),
                                                                                    slice(0, 4))), "shapes"),
    "a layer keeps nothing": (dict(store_bits=16), _nothing_kept, "keeps no positions"),
    "prompt ids as floats": (dict(store_bits="16/8"), _retyped("token_ids", torch.float32), "prompt ids"),
    "a negative prompt id": (dict(store_bits="16/8"), _negative_id, "prompt ids"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_refused_as_a_load_refuses_it(tiny_loaded, tmp_path, case):
    settings, damage, word = DAMAGE[case]
    path = signed_copy(saved(tiny_loaded, tmp_path, **settings), tmp_path, damage)
    message = refusal(load_cache, path)
    assert message is not None and word in message
    assert refusal(describe_file, path) == message


@pytest.mark.parametrize("change, word", [
    (dict(positions_dtype=torch.float32), "stored as"), (dict(keys_dtype=torch.int64), "stored as"),
    (dict(positions_change=lambda p: p.flip(1)), "out of order"), (dict(positions_change=lambda p: p + 1000), "range"),
    (dict(keys_dtype=torch.float16), None),
], ids=["positions as floats", "keys as integers", "positions descending", "positions past the prompt", "fp16 keys"])
def test_format_1_files_are_refused_as_a_load_refuses_them(tmp_path, change, word):
    model = build_tiny("llama-gqa")
    cache = prefill(model, torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(3)), Cut(24, 8))
    path = format_1_file(cache, tmp_path, **change)
    message = refusal(load_cache, path)
    assert (message is None) if word is None else word in message
    assert refusal(describe_file, path) == message


def split(path: Path) -> tuple[dict, bytes]:
    """(header, the tensors' bytes) of a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def joined(header: dict, payload: bytes, path: Path) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + payload)
    return path


def _first(header: dict) -> dict:
    return header[min(name for name in header if name != "__metadata__")]


def _overlapping(header: dict, payload: bytes):
    names = sorted(name for name in header if name != "__metadata__")
    first, second = header[names[0]], header[names[1]]
    start = first["data_offsets"][0]
    second["data_offsets"] = [start, start + second["data_offsets"][1] - second["data_offsets"][0]]
    return header, payload


def _with_digest(kept: str):
    """The file's header with only the digest `kept` of the three (older snapkv versions wrote fewer)."""
    def change(header: dict, payload: bytes):
        metadata = json.loads(header["__metadata__"]["snapkv"])
        for field in {"payload_xxh3_128", "payload_sha256_lanes", "payload_sha256"} - {kept}:
            metadata.pop(field)
        header["__metadata__"]["snapkv"] = json.dumps(metadata)
        return header, payload
    return change


def _flipped(change=None):
    """A byte of the last tensor flipped (after `change` to the header, if any): damage only a digest finds."""
    def flip(header: dict, payload: bytes):
        if change:
            header, payload = change(header, payload)
        damaged = bytearray(payload)
        damaged[-3] ^= 0x10
        return header, bytes(damaged)
    return flip


def _retyped_first(dtype: str):
    def change(header: dict, payload: bytes):
        _first(header)["dtype"] = dtype
        return header, payload
    return change


def _six_bit_floats(header: dict, payload: bytes):
    """A tensor retyped as 6-bit floats, whole bytes of them: safetensors reads it, torch does not."""
    name = next(name for name in sorted(header) if name != "__metadata__"
                and (header[name]["data_offsets"][1] - header[name]["data_offsets"][0]) % 3 == 0)
    begin, end = header[name]["data_offsets"]
    header[name].update(dtype="F6_E2M3", shape=[(end - begin) * 8 // 6])
    return header, payload


def _past_the_end(header: dict, payload: bytes):
    _first(header)["data_offsets"][1] += 10**9
    return header, payload


def _shape_lies(header: dict, payload: bytes):
    _first(header)["shape"] = [dim * 2 for dim in _first(header)["shape"]]
    return header, payload


def _cut_short(header: dict, payload: bytes):
    return header, payload[:-100]


FORGED = {  # name: (the change to the file's header and bytes, words of the message; None: it is read)
    "overlapping offsets": (_overlapping, "damaged cache file"),
    "unknown dtype": (_retyped_first("Q7"), "damaged cache file"),
    "offset past the end": (_past_the_end, "damaged cache file"),
    "shape lies": (_shape_lies, "damaged cache file"),
    "file cut short": (_cut_short, "damaged cache file"),
    "a dtype torch cannot read": (_six_bit_floats, "Dtype not understood"),
    "a flipped byte": (_flipped(), "do not match their digest"),
    "a flipped byte, sha256 in lanes": (_flipped(_with_digest("payload_sha256_lanes")), "do not match their digest"),
    "a flipped byte, plain sha256": (_flipped(_with_digest("payload_sha256")), "do not match their digest"),
    "sha256 in lanes alone": (_with_digest("payload_sha256_lanes"), None),
    "plain sha256 alone": (_with_digest("payload_sha256"), None),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_and_damaged_files_are_refused_with_the_same_words(tiny_loaded, tmp_path, case):
    change, words = FORGED[case]
    path = joined(*change(*split(saved(tiny_loaded, tmp_path, store_bits="16/8"))), tmp_path / "forged.snapkv")
    message = refusal(load_cache, path)
    assert (message is None) if words is None else (words in message and str(path) in message)
    assert refusal(describe_file, path) == message


# ---------------------------------------------------------------------------------------------- without torch

def test_info_reads_a_file_and_refuses_a_damaged_one_without_torch(tiny_loaded, tmp_path):
    path = saved(tiny_loaded, tmp_path, store_bits="3/2+20%@8/4")
    home = tmp_path / "home"
    result = without_torch("info", str(path), home=home)
    assert result.returncode == 0, messages(result)
    assert heavy_imports(result) == [] and "3/2-bit, 20% at 8/4-bit" in result.stdout
    described = json.loads(without_torch("info", str(path), "--json", home=home).stdout)
    assert {key: described[key] for key in header_figures(path)} == torch_figures(path)

    damaged = joined(*_flipped()(*split(path)), tmp_path / "damaged.snapkv")
    result = without_torch("info", str(damaged), home=home)
    assert result.returncode == 5 and heavy_imports(result) == []
    assert f"{damaged}: damaged cache (its contents do not match their digest)" in messages(result)
    assert "Traceback" not in result.stderr

    notes = tmp_path / "notes.snapkv"
    notes.write_text("Some notes, not a cache.\n" * 20)
    result = without_torch("info", str(notes), home=home)
    assert result.returncode == 5 and heavy_imports(result) == []
    assert "not a snapkv cache" in messages(result) and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------- the document

def test_info_says_whether_the_document_given_made_the_cache(tiny_loaded, tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("The vault code is 1234. " * 20)
    session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8, query_aware=False))
    session.save(session.prepare(read_sources("notes.txt")), tmp_path / "notes.snapkv")

    result = cli("info", "notes.snapkv", "notes.txt")
    assert result.code == 0 and "matches notes.txt: the cache was made from it" in " ".join(result.stdout.split())
    assert json.loads(cli("info", "notes.snapkv", "notes.txt", "--json").stdout)["matches"] is True
    alone = json.loads(cli("info", "notes.snapkv", "--json").stdout)
    assert alone["matches"] is None and alone["stale"] == []
    assert "matches" not in cli("info", "notes.snapkv").stdout

    (tmp_path / "notes.txt").write_text("The vault code is 9876. " * 20)
    result = cli("info", "notes.snapkv", "notes.txt")
    assert result.code == 5 and "STALE" in result.stdout and "matches" not in result.stdout
    assert json.loads(cli("info", "notes.snapkv", "notes.txt", "--json").stdout)["matches"] is False
    assert "is stale" in result.stderr

