"""A store shared by several machines (snapkv.storage.remote): caches under an fsspec URL, fetched whole into each
machine's local store and published there once saved; memory:// stands in for an object store here."""

import json
import uuid

import pytest

fsspec = pytest.importorskip("fsspec")

from snapkv.base.errors import StorageError  # noqa: E402
from snapkv.compression.config import DEFAULTS  # noqa: E402
from snapkv.io.documents import Document  # noqa: E402
from snapkv.session import Session  # noqa: E402
from snapkv.storage.remote import RemoteStore, open_store  # noqa: E402
from snapkv.storage.store import CacheStore  # noqa: E402

DOCUMENT = Document("The harbour dredging contract went to Calder Marine for 4.75 million pounds in March 2024. "
                    "The pilot boat Selkie entered service in June.")
QUESTION = "Who won the dredging contract?"


@pytest.fixture
def url():
    """A fresh memory:// store, emptied after the test."""
    where = f"memory://snapkv-test-{uuid.uuid4().hex[:8]}/caches"
    yield where
    memory = fsspec.filesystem("memory", skip_instance_cache=True)  # not one a test patched
    root = where.removeprefix("memory://").split("/")[0]
    if memory.exists(f"/{root}"):
        memory.rm(f"/{root}", recursive=True)


def _answer(session, prepared) -> str:
    return "".join(session.ask(prepared, QUESTION, max_new_tokens=16))


def test_a_cache_made_on_one_machine_is_a_hit_on_another(tiny_loaded, tmp_path, url):
    first_machine = RemoteStore(url, tmp_path / "first")
    made = Session(tiny_loaded, DEFAULTS, store=first_machine).prepare(DOCUMENT)
    assert not made.hit
    [entry] = first_machine.entries()
    assert first_machine.fs.exists(first_machine.remote_path(entry.key)) and entry.size == made.file_bytes
    assert not [name for name in first_machine.fs.ls(first_machine.remote_root) if "partial" in name]

    second_machine = RemoteStore(url, tmp_path / "second")  # an empty local store: the cache comes from the URL
    session = Session(tiny_loaded, DEFAULTS, store=second_machine)
    fetched = session.prepare(DOCUMENT)
    assert fetched.hit and (tmp_path / "second" / f"{entry.key}.snapkv").is_file()
    assert _answer(session, fetched) == _answer(Session(tiny_loaded, DEFAULTS), made)


def test_a_second_writer_of_the_same_document_leaves_the_first_ones_cache(tiny_loaded, tmp_path, url):
    one, two = RemoteStore(url, tmp_path / "one"), RemoteStore(url, tmp_path / "two")
    Session(tiny_loaded, DEFAULTS, store=one).prepare(DOCUMENT)
    [entry] = one.entries()
    stored = one.fs.cat_file(one.remote_path(entry.key))
    # the second machine made the same document before the first one's cache was there: saved in its local store
    Session(tiny_loaded, DEFAULTS, store=CacheStore(tmp_path / "two")).prepare(DOCUMENT)
    assert two.path_for(entry.key).is_file()
    assert two.publish(entry.key) is False  # already there: not written again
    assert one.fs.cat_file(one.remote_path(entry.key)) == stored
    assert two.publish(entry.key, replace=True) is True  # an unreadable one is replaced, whole
    assert len(one.entries()) == 1


def test_an_unreadable_cache_in_the_store_is_rebuilt_and_replaced(tiny_loaded, tmp_path, url):
    one = RemoteStore(url, tmp_path / "one")
    Session(tiny_loaded, DEFAULTS, store=one).prepare(DOCUMENT)
    [entry] = one.entries()
    damaged = bytearray(one.fs.cat_file(one.remote_path(entry.key)))
    damaged[-100:] = bytes(100)  # the payload's last bytes zeroed: its digest no longer matches
    one.fs.pipe_file(one.remote_path(entry.key), bytes(damaged))
    other = RemoteStore(url, tmp_path / "other")
    rebuilt = Session(tiny_loaded, DEFAULTS, store=other).prepare(DOCUMENT)
    assert not rebuilt.hit and any("unreadable" in note for note in rebuilt.notes)
    assert one.fs.cat_file(one.remote_path(entry.key)) == (tmp_path / "other" / f"{entry.key}.snapkv").read_bytes()


def test_a_store_out_of_reach_is_said_and_the_document_made_here(tiny_loaded, tmp_path, url, monkeypatch):
    store = RemoteStore(url, tmp_path / "local")

    def unreachable(*args, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(store.fs, "exists", unreachable)
    prepared = Session(tiny_loaded, DEFAULTS, store=store).prepare(DOCUMENT)
    assert not prepared.hit and any("connection refused" in note for note in prepared.notes)
    assert any("other machines will prefill it themselves" in note for note in prepared.notes)
    assert len(CacheStore(tmp_path / "local").entries()) == 1  # saved on this machine all the same


def test_open_store_takes_a_folder_a_file_url_an_fsspec_url_and_the_environment(tmp_path, monkeypatch, url):
    assert open_store(str(tmp_path / "shared")).root == tmp_path / "shared"
    assert open_store(f"file://{tmp_path}/nfs").root == tmp_path / "nfs"
    assert isinstance(open_store(url), RemoteStore)
    monkeypatch.setenv("SNAPKV_STORE", str(tmp_path / "from-env"))
    assert open_store().root == tmp_path / "from-env"
    monkeypatch.delenv("SNAPKV_STORE")
    assert open_store().root == CacheStore().root
    with pytest.raises(Exception, match="fsspec|protocol|not a URL|needs"):
        open_store("nosuchprotocol://bucket/caches")


def test_a_remote_store_that_cannot_be_written_says_so(tmp_path, url, monkeypatch):
    store = RemoteStore(url, tmp_path / "local")
    (tmp_path / "local").mkdir()
    store.path_for("k").write_bytes(b"a saved cache")

    def refused(*args, **kwargs):
        raise PermissionError("read-only bucket")

    monkeypatch.setattr(store.fs, "put_file", refused)
    with pytest.raises(StorageError, match="read-only bucket"):
        store.publish("k")
    assert not store.fs.exists(store.remote_path("k"))


def test_snapkv_store_points_the_cache_commands_at_the_shared_store(tiny_loaded, tmp_path, url, cli, monkeypatch):
    store = RemoteStore(url, tmp_path / "made-here")
    Session(tiny_loaded, DEFAULTS, store=store).prepare(DOCUMENT)
    [entry] = store.entries()
    monkeypatch.setenv("SNAPKV_STORE", url)
    listed = cli("cache", "list", "--json")
    assert listed.code == 0 and [item["key"] for item in json.loads(listed.stdout)] == [entry.key]
    assert url in cli("cache", "list").stdout
    assert cli("cache", "rm", entry.key[:8]).code == 0
    assert not store.fs.exists(store.remote_path(entry.key))  # gone from the shared store, not only from here
