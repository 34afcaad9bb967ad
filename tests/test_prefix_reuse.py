"""A saved cache reused by the longest prefix its prompt shares with a new one: the chunk hashes, the store's index
and its look-ups, and the session's cache made from a prefix, which answers as a fresh prefill does."""

import math

import pytest
import torch

from conftest import build_tiny
from snapkv.compression.config import SnapKVConfig
from snapkv.engine.generation import answer
from snapkv.engine.models import LoadedModel
from snapkv.io.documents import Document
from snapkv.session import Session
from snapkv.storage.prefixes import CHUNK_TOKENS, chunk_chain, longest_present, shared_length
from snapkv.storage.quantize import first_rows
from snapkv.storage.remote import RemoteStore
from snapkv.storage.store import PREFIXES, CacheStore

SETTINGS = SnapKVConfig(budget=96, window=8, store_bits=16)  # the whole prompt stored, each question cut to 96
REPORT = " ".join(f"Section {i}: the depot at Varn {i} moved {100 + 7 * i} crates on day {i % 28 + 1}." for i in range(17))
MORE = " ".join(f"Addendum {i}: a late count of {300 + i} crates." for i in range(6))  # under a chunk of tokens
LONGER = " ".join(f"Appendix {i}: the barge Orre {i} carried {40 + 3 * i} crates." for i in range(19))
QUESTIONS = ([5, 6, 7, 8], [11, 12, 13, 14, 15], [21, 22, 23])


def test_chunk_hashes_are_shared_exactly_as_far_as_the_prompts_are():
    ids = torch.arange(10 * CHUNK_TOKENS + 17)
    chain = chunk_chain("seed", ids)
    assert len(chain) == 10  # the tail shorter than a chunk is not indexed
    other = ids.clone()
    other[4 * CHUNK_TOKENS + 3] = -1  # differs in chunk 4
    assert [a == b for a, b in zip(chain, chunk_chain("seed", other))] == [True] * 4 + [False] * 6
    assert not set(chain) & set(chunk_chain("another model", ids))  # the seed is in every hash
    assert shared_length(ids, other) == 4 * CHUNK_TOKENS + 3 and shared_length(ids, ids[:40]) == 40


def test_the_longest_present_prefix_is_found_in_logarithmic_look_ups():
    for chunks in (1, 2, 7, 64, 500):
        chain = [f"h{i}" for i in range(chunks)]
        for shared in range(chunks + 1):
            asked = []
            present = lambda name: asked.append(name) or int(name[1:]) < shared
            assert longest_present(chain, present) == shared
            assert len(asked) <= math.ceil(math.log2(chunks + 1)) + 1


def test_the_store_finds_a_prefix_among_a_thousand_caches_in_a_few_look_ups(tmp_path, monkeypatch):
    store = CacheStore(tmp_path / "store")
    store.root.mkdir()
    prompts = [torch.randint(0, 50_000, (8 * CHUNK_TOKENS,), generator=torch.Generator().manual_seed(i))
               for i in range(1000)]
    for number, prompt in enumerate(prompts):
        key = f"{number:032x}"
        store.path_for(key).touch()
        store.index_prefixes("seed", prompt, key)
    asked = []
    has_entry = store._has_entry
    monkeypatch.setattr(store, "_has_entry", lambda name: asked.append(name) or has_entry(name))
    grown = torch.cat([prompts[417][: 5 * CHUNK_TOKENS + 40], torch.arange(3 * CHUNK_TOKENS)])
    path, chunks = store.longest_prefix("seed", grown)
    assert path == store.path_for(f"{417:032x}") and chunks == 5
    assert len(asked) <= 5  # log2(8 chunks) + 1, not a scan of the store
    asked.clear()
    assert store.longest_prefix("seed", torch.arange(4 * CHUNK_TOKENS)) is None and len(asked) == 1
    assert store.longest_prefix("other seed", prompts[3]) is None
    store.remove(f"{417:032x}")  # an entry whose cache is gone is a miss
    assert store.longest_prefix("seed", grown) is None
    store.clear()
    assert not (store.root / PREFIXES).exists()


def _session(loaded, tmp_path, settings=SETTINGS, name="store"):
    return Session(loaded, settings, store=CacheStore(tmp_path / name))


def _answers(loaded, prepared):
    return [list(answer(loaded.model, prepared.cache, torch.tensor(q), per_question=prepared.per_question,
                        max_new_tokens=12)) for q in QUESTIONS]


def test_a_grown_document_reuses_the_saved_prefix_and_answers_as_a_fresh_prefill(tiny_loaded, tmp_path):
    session = _session(tiny_loaded, tmp_path)
    first = session.prepare(Document(REPORT))
    assert first.tokens > CHUNK_TOKENS and first.prefix_tokens == 0
    grown = session.prepare(Document(REPORT + " " + MORE))
    fresh = _session(tiny_loaded, tmp_path, name="fresh").prepare(Document(REPORT + " " + MORE))
    shared = shared_length(first.cache.token_ids, fresh.cache.token_ids)
    assert not grown.hit and grown.prefix_tokens == grown.reused_tokens == shared > CHUNK_TOKENS
    assert torch.equal(grown.cache.token_ids, fresh.cache.token_ids) and grown.cache.document == fresh.cache.document
    assert grown.cache.tier == fresh.cache.tier
    for ours, theirs in zip(grown.cache.keys + grown.cache.values, fresh.cache.keys + fresh.cache.values):
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)  # the 16-bit rounding of the prefix
    assert _answers(tiny_loaded, grown) == _answers(tiny_loaded, fresh)
    # fewer new tokens than a chunk: made again from the prefix, not saved as a whole file more
    assert len(session.store.entries()) == 1
    again = session.prepare(Document(REPORT + " " + MORE))
    assert not again.hit and again.prefix_tokens == shared
    longer = session.prepare(Document(REPORT + " " + LONGER))  # a chunk or more of new tokens: saved, then a hit
    assert longer.tokens - longer.prefix_tokens >= CHUNK_TOKENS and len(session.store.entries()) == 2
    assert session.prepare(Document(REPORT + " " + LONGER)).hit


def test_a_shorter_document_reuses_the_prefix_it_shares(tiny_loaded, tmp_path):
    session = _session(tiny_loaded, tmp_path)
    session.prepare(Document(REPORT + " " + MORE))
    shorter = session.prepare(Document(REPORT))
    fresh = _session(tiny_loaded, tmp_path, name="fresh").prepare(Document(REPORT))
    assert shorter.prefix_tokens > CHUNK_TOKENS and torch.equal(shorter.cache.token_ids, fresh.cache.token_ids)
    assert _answers(tiny_loaded, shorter) == _answers(tiny_loaded, fresh)


def test_no_reuse_below_a_chunk_for_a_cut_tier_or_another_system_message(tiny_loaded, tmp_path):
    session = _session(tiny_loaded, tmp_path)
    short = session.prepare(Document(REPORT[:300]))
    assert short.tokens < CHUNK_TOKENS and short.path.is_file()  # a short prompt prefilled is saved as any other
    assert session.prepare(Document(REPORT[:300] + " and more.")).prefix_tokens == 0  # under one chunk in common
    cut = _session(tiny_loaded, tmp_path, SnapKVConfig(budget=96, window=8, query_aware=False, store_bits=16), "cut")
    cut.prepare(Document(REPORT))
    assert cut.prepare(Document(REPORT + " " + MORE)).prefix_tokens == 0  # its prefix is not the prefix's cache
    session.prepare(Document(REPORT))
    other = Session(tiny_loaded, SETTINGS, store=session.store, system="Answer in French.")
    assert other.prepare(Document(REPORT + " " + MORE)).prefix_tokens == 0


def test_a_sliding_window_model_prefills_rather_than_reuse_a_window_it_no_longer_holds(tiny_loaded, tmp_path):
    model = build_tiny("gemma3")
    model.resize_token_embeddings(len(tiny_loaded.tokenizer))
    loaded = LoadedModel(model, tiny_loaded.tokenizer, "tiny-gemma3", torch.device("cpu"), torch.float32)
    session = _session(loaded, tmp_path)
    assert not session.prepare(Document(REPORT)).cache.holds_every_position
    grown = session.prepare(Document(REPORT + " " + MORE))
    assert grown.prefix_tokens == 0 and not grown.hit


def test_a_shared_store_finds_another_machines_prefix(tiny_loaded, tmp_path):
    pytest.importorskip("fsspec")
    url = f"memory://prefix-test-{tmp_path.name}"
    one = Session(tiny_loaded, SETTINGS, store=RemoteStore(url, tmp_path / "one"))
    one.prepare(Document(REPORT))
    two = Session(tiny_loaded, SETTINGS, store=RemoteStore(url, tmp_path / "two"))  # nothing in its own folder
    grown = two.prepare(Document(REPORT + " " + MORE))
    assert grown.prefix_tokens > CHUNK_TOKENS and not grown.hit
    two.store.clear()
    assert not two.store.fs.exists(f"{two.store.remote_root}/{PREFIXES}")


@pytest.mark.parametrize("bits, as_it_was", [("16/8", True), ("8", False), ("4/3", False)])
def test_the_saved_prefix_is_stored_again_as_it_was_and_answers_as_a_fresh_prefill(tiny_loaded, tmp_path, bits,
                                                                                    as_it_was):
    """Where each token is stored on its own (16-bit keys, values per token) the prefix's stored rows are taken as
    they are, byte for byte; where keys are grouped along tokens (8 and 4 bits) the whole cache is rounded again (the
    prefix's values to within a step). Either way, a fresh prefill's answers."""
    settings = SnapKVConfig(budget=96, window=8, store_bits=bits)
    session = _session(tiny_loaded, tmp_path, settings)
    first = session.prepare(Document(REPORT))
    grown = session.prepare(Document(REPORT + " " + LONGER))
    fresh = _session(tiny_loaded, tmp_path, settings, "fresh").prepare(Document(REPORT + " " + LONGER))
    shared = grown.prefix_tokens
    assert shared > CHUNK_TOKENS and _answers(tiny_loaded, grown) == _answers(tiny_loaded, fresh)
    saved = session.load_file(first.path).cache
    compared = 0
    for ours, theirs in zip(grown.cache.payload, saved.payload):
        for part, before in zip(ours, theirs):
            ours_rows, their_rows = first_rows(part, shared), first_rows(before, shared)
            if their_rows is None:
                continue  # keys grouped along tokens (8 and 4 bits): a group straddles the prefix's end
            for a, b in ([(ours_rows, their_rows)] if isinstance(part, torch.Tensor) else
                         zip((ours_rows.packed, ours_rows.scale, ours_rows.minimum),
                             (their_rows.packed, their_rows.scale, their_rows.minimum))):
                assert torch.equal(a, b) if as_it_was else torch.allclose(a.float(), b.float(), atol=2, rtol=1e-2)
                compared += 1
    assert compared >= len(saved.payload)  # every layer's values at least
