"""Saved caches: round trips, refusals of damaged or foreign files, atomic and concurrent writes."""

import json
import multiprocessing
import os
import pickle
import signal
import struct
import time
from dataclasses import replace

import pytest
import torch

from conftest import build_tiny
from snapkv.storage.cachefile import load_cache, read_metadata, save_cache
from snapkv.compression.config import Cut, SnapKVConfig
from snapkv.io.documents import Document, Source
from snapkv.base.errors import CacheFileError, IncompatibleCacheError
from snapkv.engine.generation import answer, prefill
from snapkv.engine.models import LoadedModel
from snapkv.session import Session
from snapkv.storage.store import CacheStore

DOCUMENT = Document(" ".join(f"Paragraph {i} tells of rivers, bread and maps." for i in range(40)))


def caches_equal(a, b) -> bool:
    return (a.original_length == b.original_length and torch.equal(a.token_ids, b.token_ids)
            and all(torch.equal(x, y) for x, y in zip(a.keys + a.values + a.positions,
                                                      b.keys + b.values + b.positions)))


def saved(tiny_loaded, tmp_path, settings=SnapKVConfig(budget=64, window=8, query_aware=False, store_bits=16)):
    session = Session(tiny_loaded, settings, store=CacheStore(tmp_path / "store"))
    prepared = session.prepare(DOCUMENT)
    return session, prepared


def test_round_trip_and_identical_answers(tiny_loaded, tmp_path):
    session, prepared = saved(tiny_loaded, tmp_path)
    assert prepared.path.is_file() and not prepared.hit and prepared.cache.compressed
    loaded = session.load_file(prepared.path)
    assert caches_equal(prepared.cache, loaded.cache)
    question = torch.tensor([5, 6, 7, 8])
    before = list(answer(tiny_loaded.model, prepared.cache, question, max_new_tokens=10))
    after = list(answer(tiny_loaded.model, loaded.cache, question, max_new_tokens=10))
    assert before == after
    metadata = read_metadata(prepared.path)
    assert metadata["mode"] == "document-window" and metadata["tier"]["cut"]["budget"] == 64
    assert metadata["per_question"] is None and metadata["tier"]["truncation"] is None
    assert metadata["original_length"] == prepared.cache.original_length
    assert metadata["model"]["name"] == "tiny-llama"


def test_file_size_is_close_to_the_tensors(tiny_loaded, tmp_path):
    _, prepared = saved(tiny_loaded, tmp_path)
    cache = prepared.cache
    masks = sum(p.shape[0] * ((cache.original_length + 7) // 8) for p in cache.positions)
    tensors_bytes = cache.stored_kv_bytes + masks + cache.original_length * 4
    assert cache.stored_kv_bytes == cache.kv_bytes // 2  # fp32 compute, 16-bit file
    assert tensors_bytes <= prepared.file_bytes <= tensors_bytes * 1.05 + 8192


def count_forwards(model) -> list:
    """A list that grows by one at every forward pass of `model` (remove the hook with .handle.remove())."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls, handle


def test_second_prepare_is_a_hit_without_prefill(tiny_loaded, tmp_path):
    session, first = saved(tiny_loaded, tmp_path)
    forwards, handle = count_forwards(tiny_loaded.model)
    try:
        second = session.prepare(DOCUMENT)
        assert forwards == []  # nothing ran through the model: the file was read
        assert second.hit and second.path == first.path and second.prefill_seconds == 0
        assert caches_equal(first.cache, second.cache)
        entries = session.store.entries()
        assert [e.path for e in entries] == [first.path] and entries[0].size == first.path.stat().st_size
        # other settings are another entry
        # (8 bits: a sharper share, the default, would add its probe passes to the one prefill counted here)
        other = Session(tiny_loaded, SnapKVConfig(budget=48, window=8, query_aware=False, store_bits=8),
                        store=session.store)
        assert not other.prepare(DOCUMENT).hit and len(forwards) == 1
    finally:
        handle.remove()
    assert len(session.store.entries()) == 2
    assert session.store.remove(entries[0].key) and session.store.clear() == 1
    assert session.store.entries() == []


def test_query_aware_saves_the_stored_tier(tiny_loaded, tmp_path):
    session, prepared = saved(tiny_loaded, tmp_path, SnapKVConfig(budget=32, window=8, store_keep=None,
                                                                  store_budget=96, store_method="snapkv"))
    assert prepared.cache.kept_tokens == 96
    metadata = read_metadata(prepared.path)
    assert metadata["tier"]["cut"]["budget"] == 96 and metadata["per_question"]["budget"] == 32
    assert metadata["mode"] == "query-aware"
    question = torch.tensor([9, 10, 11])
    reloaded = session.load_file(prepared.path)
    assert reloaded.per_question == prepared.per_question == Cut(32, 8, whole_words=True)
    cut = prepared.per_question
    assert list(answer(tiny_loaded.model, prepared.cache, question, per_question=cut, max_new_tokens=8)) == \
        list(answer(tiny_loaded.model, reloaded.cache, question, per_question=cut, max_new_tokens=8))


def test_load_into_another_dtype(tiny_loaded, tmp_path):
    _, prepared = saved(tiny_loaded, tmp_path)
    cache, _ = load_cache(prepared.path, dtype=torch.bfloat16)
    assert cache.keys[0].dtype == torch.bfloat16
    assert torch.equal(cache.keys[0], prepared.cache.keys[0].to(torch.bfloat16))


def test_cache_of_another_model_is_refused(tiny_loaded, tmp_path, embedded):
    session, prepared = saved(tiny_loaded, tmp_path)
    other_model = build_tiny("llama-gqa", seed=1)
    other_model.resize_token_embeddings(len(embedded.tokenizer))
    other = Session(LoadedModel(other_model, embedded.tokenizer, "tiny-llama-2", torch.device("cpu"), torch.float32),
                    None)
    with pytest.raises(IncompatibleCacheError, match="model weights"):
        other.load_file(prepared.path)


def test_truncated_files_are_refused(tiny_loaded, tmp_path):
    _, prepared = saved(tiny_loaded, tmp_path)
    data = prepared.path.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    offsets = list(range(0, header_end, 8))[:150]
    offsets += [header_end + (len(data) - header_end) * i // 50 for i in range(50)]
    assert len(offsets) == 200
    cut = tmp_path / "cut.snapkv"
    for offset in offsets:
        cut.write_bytes(data[:offset])
        with pytest.raises(CacheFileError):
            load_cache(cut)


def test_flipped_payload_byte_is_refused(tiny_loaded, tmp_path):
    _, prepared = saved(tiny_loaded, tmp_path)
    data = bytearray(prepared.path.read_bytes())
    data[len(data) - 1000] ^= 0x10
    prepared.path.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="digest"):
        load_cache(prepared.path)


class _Marker:
    def __reduce__(self):
        return (open, (os.environ["SNAPKV_PICKLE_MARKER"], "w"))


def test_pickle_renamed_snapkv_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "pickle-ran"
    monkeypatch.setenv("SNAPKV_PICKLE_MARKER", str(marker))
    fake = tmp_path / "evil.snapkv"
    fake.write_bytes(pickle.dumps(_Marker()))
    with pytest.raises(CacheFileError):
        load_cache(fake)
    torch.save({"x": torch.zeros(3)}, tmp_path / "torch.snapkv")
    with pytest.raises(CacheFileError):
        load_cache(tmp_path / "torch.snapkv")
    assert not marker.exists()


def test_newer_format_is_refused(tiny_loaded, tmp_path):
    from safetensors.torch import load_file, save_file

    _, prepared = saved(tiny_loaded, tmp_path)
    metadata = read_metadata(prepared.path)
    metadata["version"] = "6.1"
    save_file(load_file(str(prepared.path)), str(tmp_path / "new.snapkv"), metadata={"snapkv": json.dumps(metadata)})
    with pytest.raises(CacheFileError, match=r"newer snapkv \(cache format 6.1; this snapkv reads formats 1.x to "
                                             r"5.x\). Upgrade snapkv"):
        load_cache(tmp_path / "new.snapkv")


def _save_forever(path, cache):
    while True:
        save_cache(path, cache)


def big_cache(tiny_loaded):
    """About 12 MB as stored, so that a write takes long enough to be killed in the middle. Rounded to its
    stored precision here, in the parent: forked writers must not start torch's thread pool."""
    cache = prefill(tiny_loaded.model, torch.arange(3, 600) % 250 + 3, None)
    repeated = [k.repeat(1, 1, 32) for k in cache.keys]
    cache = replace(cache, keys=repeated, values=[v.repeat(1, 1, 32) for v in cache.values],
                    positions=[torch.arange(k.shape[1]).expand(k.shape[0], -1) for k in repeated],
                    original_length=repeated[0].shape[1], token_ids=torch.arange(repeated[0].shape[1]) % 250)
    return cache.at_precision(16)


@pytest.mark.slow
def test_sigkill_mid_save_never_leaves_a_partial_file(tiny_loaded, tmp_path):
    path = tmp_path / "store" / "victim.snapkv"
    cache = big_cache(tiny_loaded)
    context = multiprocessing.get_context("fork")
    killed_mid_save = 0
    for attempt in range(30):
        writer = context.Process(target=_save_forever, args=(path, cache))
        writer.start()
        time.sleep(0.15 + 0.037 * attempt)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        killed_mid_save += bool(list(path.parent.glob(".*.tmp")))
        if path.exists():
            loaded, _ = load_cache(path)  # a complete, valid file
            assert loaded.original_length == cache.original_length
        if killed_mid_save >= 3:
            break
    assert killed_mid_save >= 1, "no kill landed during a write: the test did not exercise what it claims"
    save_cache(path, cache)  # the next save sweeps the temp files the killed writers left
    assert not list(path.parent.glob(".*.tmp"))


def test_four_concurrent_writers_end_with_one_valid_file(tiny_loaded, tmp_path):
    path = tmp_path / "store" / "shared.snapkv"
    cache = big_cache(tiny_loaded)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=save_cache, args=(path, cache),
                               kwargs={"sources": [Source(f"writer{i}", i, "0" * 64)]}) for i in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    loaded, metadata = load_cache(path)
    assert metadata["sources"][0]["name"] in {f"writer{i}" for i in range(4)}
    assert caches_equal(loaded, cache.to("cpu"))
    assert [p.name for p in path.parent.iterdir()] == ["shared.snapkv"]  # no temp, no lock file


def test_damaged_store_entry_is_rebuilt(tiny_loaded, tmp_path):
    session, first = saved(tiny_loaded, tmp_path)
    first.path.write_bytes(first.path.read_bytes()[:100])
    again = session.prepare(DOCUMENT)
    assert not again.hit and "rebuilt" in " ".join(again.notes)
    assert caches_equal(session.load_file(again.path).cache, first.cache)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_truncation_fits_the_context(tiny_loaded, where):
    from snapkv.base.errors import DocumentError
    from snapkv.engine.prompting import document_ids

    text = " ".join(f"w{i}" for i in range(1500))
    body = document_ids(tiny_loaded.tokenizer, text)
    with pytest.raises(DocumentError, match="--truncate"):
        Session(tiny_loaded, None).prompt(Document(text))
    session = Session(tiny_loaded, None, truncate=where)
    prompt = session.prompt(Document(text))
    ids = prompt.ids.tolist()
    assert len(ids) == 1024 - 128  # the context less the room kept for question and answer
    short = Session(tiny_loaded, None).prompt(Document("w1")).ids
    template_tokens = len(short) - len(document_ids(tiny_loaded.tokenizer, "w1"))
    assert prompt.truncation.side == where
    assert prompt.truncation.tokens == len(body) - (len(ids) - template_tokens) > 0
    kept = len(body) - prompt.truncation.tokens
    joined = ",".join(map(str, ids))
    if where == "start":
        assert ",".join(map(str, body[-kept:])) in joined
    elif where == "end":
        assert ",".join(map(str, body[:kept])) in joined
    else:
        assert ",".join(map(str, body[: kept // 2])) in joined and ",".join(map(str, body[-(kept - kept // 2):])) in joined


def test_the_digests_cover_every_byte_and_files_with_any_of_them_load(tiny_loaded, tmp_path):
    """What is written: payload_sha256 (for the earliest snapkv versions), payload_sha256_lanes (the same bytes hashed
    in runs at once) and payload_xxh3_128 (the checksum this version checks where present). A byte flipped anywhere is
    found by each; a file with only the older digests still loads; a wrong one present is refused."""
    from safetensors.torch import load_file, save_file

    from snapkv.storage.cachefile import DIGEST_LANES, payload_checksum, payload_digest

    _, prepared = saved(tiny_loaded, tmp_path)
    metadata = read_metadata(prepared.path)
    tensors = load_file(str(prepared.path))
    assert metadata["payload_sha256"] == payload_digest(tensors)
    assert metadata["payload_sha256_lanes"] == {"lanes": DIGEST_LANES, "sha256": payload_digest(tensors, DIGEST_LANES)}
    assert metadata["payload_xxh3_128"] == payload_checksum(tensors) and len(payload_checksum(tensors)) == 32
    assert payload_digest(tensors, 3) not in (payload_digest(tensors), payload_digest(tensors, 2))
    names = sorted(tensors)
    for name in (names[0], names[len(names) // 2], names[-1]):  # the first run, the middle, the last
        for byte in (0, -1):
            changed = dict(tensors)
            changed[name] = tensors[name].clone()
            changed[name].view(-1).view(torch.uint8)[byte] ^= 1
            assert all(payload_digest(changed, lanes) != payload_digest(tensors, lanes) for lanes in (1, 2, 3))
            assert payload_checksum(changed) != payload_checksum(tensors)
    renamed = {("x" + name if name == names[0] else name): tensor for name, tensor in tensors.items()}
    assert payload_checksum(renamed) != payload_checksum(tensors)  # names are covered, not only bytes

    def written(**fields):
        path = tmp_path / "variant.snapkv"
        save_file(tensors, str(path), metadata={"snapkv": json.dumps({**metadata, **fields})})
        return path

    with pytest.raises(CacheFileError, match="digest"):  # the checksum is what is checked where present
        load_cache(written(payload_xxh3_128="0" * 32))
    del metadata["payload_xxh3_128"]  # as the previous snapkv wrote it: the digest in lanes is checked
    load_cache(written())
    with pytest.raises(CacheFileError, match="digest"):
        load_cache(written(payload_sha256_lanes={"lanes": 2, "sha256": "0" * 64}))
    del metadata["payload_sha256_lanes"]  # as the earliest versions wrote it
    load_cache(written())
    with pytest.raises(CacheFileError, match="digest"):
        load_cache(written(payload_sha256="0" * 64))
