"""The embedded SQLite store: first writer wins, integrity, source index, foreign files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from farm.core.errors import ForeignStoreError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.store import PutResult, SQLiteStore

NS = Namespace.for_fingerprint("pocl-test-device-0123456789ab")
OTHER_NS = Namespace.for_fingerprint("nvidia-h200-0123456789ab")


def lowered(text: str) -> Lowered:
    """A source as a batch lowers it: the only way an artifact enters the source index."""
    return Lowered(source=text, kernel_names=("k",))


LOW = lowered("__kernel void k() {}")
SRC = LOW.source_hash


def key(i: int, build: str = "b1b1b1b1") -> Key:
    return Key(id_hash=f"{i:032x}", build_id=build)


def art(k: Key, payload: bytes = b"binary", source: str = SRC) -> Artifact:
    return Artifact.create(k, "fam", payload, source)


@pytest.fixture
def store(tmp_path: Path) -> SQLiteStore:
    s = SQLiteStore(tmp_path / "store.sqlite")
    yield s
    s.close()


def test_roundtrip_and_namespaces_are_separate(store: SQLiteStore) -> None:
    a = art(key(1))
    assert store.put(NS, a) is PutResult.STORED
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"binary" and got.meta.digest == a.meta.digest
    assert store.get(OTHER_NS, key(1)) is None
    assert store.existing(NS, [key(1), key(2)]) == {key(1)}
    assert store.namespaces() == [NS]


def test_first_writer_wins(store: SQLiteStore) -> None:
    assert store.put(NS, art(key(1), b"first")) is PutResult.STORED
    assert store.put(NS, art(key(1), b"first")) is PutResult.SAME
    assert store.put(NS, art(key(1), b"second")) is PutResult.REFUSED
    assert store.stats.refused == 1
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"first"


def test_corrupt_artifact_is_a_miss_and_put_repairs_it(store: SQLiteStore,
                                                       tmp_path: Path) -> None:
    store.put(NS, art(key(1), b"good bytes"))
    conn = sqlite3.connect(tmp_path / "store.sqlite")
    conn.execute("UPDATE artifacts SET binary=? WHERE id_hash=?", (b"evil bytes", f"{1:032x}"))
    conn.commit()
    conn.close()
    assert store.get(NS, key(1)) is None
    assert store.stats.corrupt == 1
    assert key(1) in store.existing(NS, [key(1)])  # present, but not served
    assert store.put(NS, art(key(1), b"good bytes")) is PutResult.STORED
    assert store.stats.repaired == 1
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"good bytes"


def test_source_index_and_rekey_copy_and_move(store: SQLiteStore) -> None:
    low = lowered("a")
    src = low.source_hash
    store.put(NS, art(key(1, "b1b1b1b1"), b"x", src), source=low)
    assert store.find_source(NS, src) == key(1, "b1b1b1b1")
    copied = store.rekey(NS, key(1, "b1b1b1b1"), key(2, "b1b1b1b1"), move=False, source=low)
    assert copied is not None and copied.meta.key == key(2, "b1b1b1b1")
    assert store.get(NS, key(1, "b1b1b1b1")) is not None
    moved = store.rekey(NS, key(2, "b1b1b1b1"), key(2, "b2b2b2b2"), move=True, source=low)
    assert moved is not None
    assert store.get(NS, key(2, "b1b1b1b1")) is None
    assert store.find_source(NS, src) == key(2, "b2b2b2b2")


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, b"SQLite format 3\x00" + b"\0" * 50])
def test_foreign_files_are_refused_untouched(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "store.sqlite"
    path.write_bytes(content)
    if not content:  # an empty file is a new store
        SQLiteStore(path).close()
        return
    with pytest.raises(ForeignStoreError, match=str(path)):
        SQLiteStore(path)
    assert path.read_bytes() == content


def test_other_sqlite_database_and_newer_version_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    with pytest.raises(ForeignStoreError, match="not a kernel-farm store"):
        SQLiteStore(other)
    assert other.read_bytes() == before
    path = tmp_path / "store.sqlite"
    SQLiteStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET v='99' WHERE k='version'")
    conn.commit()
    conn.close()
    with pytest.raises(ForeignStoreError, match="version 99"):
        SQLiteStore(path)


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ForeignStoreError, match="not a file"):
        SQLiteStore(tmp_path)
