"""Crafted metadata with a recomputed checksum: every value typed and bounded, each refusal naming its field."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from snapkv.storage.cachefile import load_cache, payload_signatures, read_metadata
from snapkv.storage.cacheschema import MAX_HEAD_DIM, MAX_KERNEL, check_metadata
from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.base.errors import CacheFileError
from snapkv.session import Session


@pytest.fixture
def saved(tiny_loaded, tmp_path):
    """A query-aware cache of the tiny model in the default bits: (path, metadata, tensors)."""
    session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8))
    prepared = session.prepare(Document(" ".join(f"Line {i} of the ledger holds {i * 3}." for i in range(20))))
    path = tmp_path / "good.snapkv"
    session.save(prepared, path)
    return path, read_metadata(path), load_file(str(path))


def rewritten(saved, tmp_path, change=None, tensors_change=None, raw: str | None = None):
    """The saved file with its metadata (or tensors) changed and every digest recomputed to match."""
    _, metadata, tensors = saved
    metadata, tensors = json.loads(json.dumps(metadata)), dict(tensors)
    if tensors_change:
        tensors_change(tensors)
    metadata.update(payload_signatures(tensors))
    if change:
        change(metadata)
    path = tmp_path / "crafted.snapkv"
    save_file(tensors, str(path), metadata={"snapkv": raw if raw is not None else json.dumps(metadata)})
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def change(metadata):
        node = metadata
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return change


@pytest.mark.parametrize("change, field", [
    (_set("storage", "head_dim", 10**6), "storage.head_dim"),
    (_set("storage", "head_dim", True), "storage.head_dim"),
    (_set("storage", "kv_heads", 0), "storage.kv_heads"),
    (_set("per_question", "kernel", 2**32 + 15), "per_question.kernel"),
    (_set("per_question", "kernel", 10**8 + 1), "per_question.kernel"),
    (_set("per_question", "kernel", 15.0), "per_question.kernel"),
    (_set("per_question", "kernel", 16), "per_question.kernel"),
    (_set("per_question", "budget", -4), "per_question.budget"),
    (_set("per_question", "window", "8"), "per_question.window"),
    (_set("per_question", "pooling", "median"), "per_question.pooling"),
    (_set("per_question", "method", "pickle"), "per_question.method"),
    (_set("per_question", "surprise", 1), "unknown setting"),
    (_set("model", []), "model"),
    (_set("model", "num_layers", 10**9), "model.num_layers"),
    (_set("storage", None), "storage"),
    (_set("storage", "values", "group", 10**9), "storage.values.group"),
    (_set("storage", "values", "bits", 5), "storage.values.bits"),
    (_set("storage", "values", "axis", "diagonal"), "storage.values.axis"),
    (_set("storage", "format", 1), "storage.format"),
    (_set("storage", "bits", "4"), "tier.bits"),  # the file holds the default, 8
    (_set("tier", "cut", "xy"), "tier.cut"),
    (_set("tier", "truncation", {"side": "up", "tokens": 3}), "tier.truncation.side"),
    (_set("sources", [{"name": 5, "size": 1, "sha256": "ab"}]), "sources[0].name"),
    (_set("sources", {"name": "a"}), "sources"),
    (_set("created", "yesterday"), "created"),
    (_set("num_layers", 2**40), "num_layers"),
    (_set("original_length", 0), "original_length"),
    (_set("document_span", [5, 2]), "document_span[1]"),
    (_set("mode", "everything"), "mode"),
    (_set("payload_sha256_lanes", {"lanes": 10**6, "sha256": "ab"}), "payload_sha256_lanes.lanes"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_crafted_values_are_refused_by_name(saved, tmp_path, change, field):
    path = rewritten(saved, tmp_path, change)
    with pytest.raises(CacheFileError, match="damaged metadata") as refused:
        load_cache(path)
    assert field in str(refused.value)


def test_json_that_is_not_json_and_versions_that_are_not_versions(saved, tmp_path):
    _, metadata, _ = saved
    with_nan = json.dumps({**metadata, "created": float("nan")})  # NaN: Python writes it, JSON has none
    with pytest.raises(CacheFileError, match="not valid JSON"):
        load_cache(rewritten(saved, tmp_path, raw=with_nan))
    deep = json.dumps({**metadata, "unknown": "["}).replace('"["', "[" * 100_000 + "]" * 100_000)
    with pytest.raises(CacheFileError, match="not valid JSON"):
        load_cache(rewritten(saved, tmp_path, raw=deep))
    for version in ("0.9", " 4.0", "+4.0", "4", 4.0):
        with pytest.raises(CacheFileError, match="format version"):
            load_cache(rewritten(saved, tmp_path, _set("version", version)))


def test_prompt_ids_and_kept_positions_are_checked(saved, tmp_path, tiny_loaded):
    def ids_of(dtype):
        return lambda tensors: tensors.__setitem__("token_ids", tensors["token_ids"].to(dtype))

    with pytest.raises(CacheFileError, match="prompt ids"):
        load_cache(rewritten(saved, tmp_path, tensors_change=ids_of(torch.float32)))

    def negative(tensors):
        tensors["token_ids"] = tensors["token_ids"].clone()
        tensors["token_ids"][3] = -1
    with pytest.raises(CacheFileError, match="prompt ids"):
        load_cache(rewritten(saved, tmp_path, tensors_change=negative))

    def beyond(tensors):  # within any vocabulary's bound, beyond this model's
        tensors["token_ids"] = tensors["token_ids"].clone()
        tensors["token_ids"][3] = tiny_loaded.model.get_input_embeddings().num_embeddings + 5
    path = rewritten(saved, tmp_path, tensors_change=beyond)
    load_cache(path)  # no model given (info): in range of any vocabulary
    with pytest.raises(CacheFileError, match="beyond the model's"):
        Session(tiny_loaded, None).load_file(path)


@pytest.mark.parametrize("settings", [
    dict(store_bits=16), dict(store_bits=8), dict(store_bits="4/3"), dict(store_bits="3/2+20%@8/4"),
    dict(store_keep=0.5, store_bits=4), dict(query_aware=False), dict(store_keep=0.6, store_method="reconstruction"),
])
def test_every_file_snapkv_writes_passes(tiny_loaded, tmp_path, settings):
    session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8, **settings))
    prepared = session.prepare(Document(" ".join(f"Line {i} of the ledger holds {i * 3}." for i in range(20))))
    session.save(prepared, tmp_path / "any.snapkv")
    metadata = read_metadata(tmp_path / "any.snapkv")  # checked as it is read
    check_metadata(metadata, int(metadata["version"].split(".")[0]))
    assert MAX_HEAD_DIM >= 256 and MAX_KERNEL >= 15  # room for every real model and the defaults


def test_a_layer_that_keeps_nothing_is_refused(tiny_loaded, tmp_path):
    session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8, store_bits=16))
    prepared = session.prepare(Document(" ".join(f"Line {i} of the ledger holds {i * 3}." for i in range(20))))
    session.save(prepared, tmp_path / "whole.snapkv")
    saved = (tmp_path / "whole.snapkv", read_metadata(tmp_path / "whole.snapkv"), load_file(str(tmp_path / "whole.snapkv")))

    def nothing_kept(tensors):
        keys = tensors["layers.0.keys"]
        tensors["layers.0.keys"] = keys[:, :0].contiguous()
        tensors["layers.0.values"] = tensors["layers.0.values"][:, :0].contiguous()
        tensors["layers.0.kept"] = torch.zeros_like(tensors["layers.0.kept"])
    with pytest.raises(CacheFileError, match="keeps no positions"):
        load_cache(rewritten(saved, tmp_path, tensors_change=nothing_kept))


def test_format_1_files_are_held_to_the_same_rules(tiny_loaded, tmp_path):
    """A snapkv 0.1 file (plain tensors, positions listed): its positions must be whole numbers, its keys floats."""
    from snapkv.storage.cachefile import payload_digest
    from snapkv.compression.config import Cut
    from snapkv.engine.generation import prefill

    cache = prefill(tiny_loaded.model, torch.arange(3, 63), Cut(24, 8))
    metadata = {"format": "snapkv-cache", "version": "1.0", "model": tiny_loaded.identity, "mode": "document-window",
                "stored": {"budget": 24, "window": 8, "kernel": 15, "pooling": "max"}, "settings": {},
                "original_length": 60, "num_layers": cache.num_layers, "dtype": "float32", "sources": []}

    def written(positions_dtype=torch.int32, keys_dtype=torch.float32, **changes):
        tensors = {"token_ids": cache.token_ids.to(torch.int32)}
        for index, (keys, values, positions) in enumerate(zip(cache.keys, cache.values, cache.positions)):
            tensors.update({f"layers.{index}.keys": keys.to(keys_dtype), f"layers.{index}.values": values,
                            f"layers.{index}.positions": positions.to(positions_dtype)})
        path = tmp_path / "old.snapkv"
        data = {**metadata, **changes, "payload_sha256": payload_digest(tensors)}
        save_file(tensors, str(path), metadata={"snapkv": json.dumps(data)})
        return path

    load_cache(written())  # as snapkv 0.1 wrote it
    with pytest.raises(CacheFileError, match="stored as"):
        load_cache(written(positions_dtype=torch.float32))
    with pytest.raises(CacheFileError, match="stored as"):
        load_cache(written(keys_dtype=torch.int64))
    with pytest.raises(CacheFileError, match="format 1.0 settings"):
        load_cache(written(stored=[1, 2]))
    with pytest.raises(CacheFileError, match="tier.cut.kernel"):
        load_cache(written(stored={"budget": 24, "window": 8, "kernel": 10**8 + 1, "pooling": "max"}))
