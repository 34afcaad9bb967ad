"""Fuzzing the two readers of untrusted bytes: the cache loader and the document reader.

Whatever the bytes, each either returns a result or raises its own domain error; never anything else.
Brief runs here (a fixed number of examples); raise max_examples locally for a longer hunt.
"""

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdf_fixtures as pdf
from conftest import build_tiny
from snapkv.io.documents import read_file
from snapkv.base.errors import CacheFileError, DocumentError, IncompatibleCacheError
from snapkv.engine.generation import prefill
from snapkv.storage.cachefile import load_cache, save_cache

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


@pytest.fixture(scope="module")
def cache_bytes(tmp_path_factory) -> bytes:
    model = build_tiny("llama-gqa")
    cache = prefill(model, torch.arange(3, 60), None)
    path = tmp_path_factory.mktemp("fuzz") / "seed.snapkv"
    save_cache(path, cache)
    return path.read_bytes()


# A mutation: flip bytes at positions, cut the file, or splice random bytes in.
mutations = st.one_of(
    st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=8)
    .map(lambda flips: ("flip", flips)),
    st.floats(0, 1, exclude_max=True).map(lambda where: ("cut", where)),
    st.tuples(st.floats(0, 1), st.binary(min_size=1, max_size=64)).map(lambda splice: ("splice", splice)),
    st.integers(0, 2**64 - 1).map(lambda length: ("header_length", length)),
)


def mutate(data: bytes, mutation) -> bytes:
    kind, argument = mutation
    out = bytearray(data)
    if kind == "flip":
        for where, mask in argument:
            out[int(where * len(out))] ^= mask
    elif kind == "cut":
        del out[int(argument * len(out)):]
    elif kind == "splice":
        where, extra = argument
        out[int(where * len(out)):int(where * len(out))] = extra
    else:
        out[:8] = struct.pack("<Q", argument)
    return bytes(out)


@settings(FUZZ, max_examples=1000)
@given(mutation=mutations)
def test_cache_loader_never_fails_unexpectedly(cache_bytes, tmp_path, mutation):
    path = tmp_path / "fuzzed.snapkv"
    data = mutate(cache_bytes, mutation)
    path.write_bytes(data)
    try:
        cache, _ = load_cache(path)
    except (CacheFileError, IncompatibleCacheError):
        return
    # accepted: then it must be the original payload (the digest covers every tensor byte)
    original = tmp_path / "original.snapkv"
    original.write_bytes(cache_bytes)
    reference, _ = load_cache(original)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, reference.keys + reference.values))


@settings(FUZZ, max_examples=300)
@given(data=st.binary(max_size=2048), suffix=st.sampled_from([".txt", ".md", ".html", ""]))
def test_text_reader_never_fails_unexpectedly(tmp_path, data, suffix):
    path = tmp_path / f"doc{suffix}"
    path.write_bytes(data)
    try:
        text, source = read_file(path)
    except DocumentError:
        return
    assert text.strip() and source.size == len(data)


SEED_PDF = pdf.text_pdf([["Quarterly figures: revenue 42, costs 17."], ["Second page."]])


@settings(FUZZ, max_examples=40)
@given(mutation=mutations)
def test_pdf_reader_never_fails_unexpectedly(tmp_path, mutation):
    path = tmp_path / "doc.pdf"
    path.write_bytes(mutate(SEED_PDF, mutation))
    try:
        text, _ = read_file(path)
    except DocumentError:
        return
    assert text.startswith("[page 1]")
