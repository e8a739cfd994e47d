"""The tiered store: a local SQLite tier in front of a real MinIO (the shared truth).

Remote hits land in the local tier, puts write through with the shared tier deciding,
the local tier never disagrees with the shared one after a put, and a corrupt local copy
falls through to the remote. The in-memory tier is tested here too, as the front tier
it is meant to be.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.devservices import MinioServer
from farm.store import ArtifactStore, MemoryStore, PutResult, SQLiteStore, TieredStore
from farm.store.minio import MinioStore

NS = Namespace.for_fingerprint("pocl-test-device-0123456789ab")
OTHER_NS = Namespace.for_fingerprint("nvidia-h200-0123456789ab")


def lowered(text: str) -> Lowered:
    """A source as a batch lowers it: the only way an artifact enters the source index."""
    return Lowered(source=text, kernel_names=("k",))


LOW = lowered("__kernel void k() {}")
SRC = LOW.source_hash


def key(i: int, build: str = "b1b1b1b1") -> Key:
    return Key(id_hash=f"{i:032x}", build_id=build)


def art(k: Key, payload: bytes = b"binary", source: str = SRC, **extra: Any) -> Artifact:
    return Artifact.create(k, "fam", payload, source, **extra)


class CountingPool(urllib3.PoolManager):
    """A connection pool that counts the requests sent to MinIO: a hit served locally
    sends none."""

    def __init__(self) -> None:
        super().__init__(retries=False, timeout=urllib3.Timeout(connect=5, read=30))
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def urlopen(self, method: str, url: str, redirect: bool = True,  # type: ignore[override]
                **kw: Any) -> urllib3.BaseHTTPResponse:  # (PoolManager's own signature)
        with self._lock:
            self.requests.append((method, url))
        return super().urlopen(method, url, redirect=redirect, **kw)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()


def corrupt_sqlite(path: Path, k: Key) -> None:
    conn = sqlite3.connect(path)
    conn.execute("UPDATE artifacts SET binary=? WHERE id_hash=? AND build_id=?",
                 (b"evil bytes", k.id_hash, k.build_id))
    conn.commit()
    conn.close()


@pytest.fixture
def bucket() -> str:
    return f"farm-test-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def pool() -> CountingPool:
    return CountingPool()


@pytest.fixture
def remote(minio_server: MinioServer, bucket: str, pool: CountingPool) -> Iterator[MinioStore]:
    s = MinioStore(minio_server.endpoint, minio_server.access_key, minio_server.secret_key,
                   bucket, http_client=pool)
    yield s
    s.close()


@pytest.fixture
def other_machine(minio_server: MinioServer, bucket: str) -> Iterator[MinioStore]:
    """Another worker writing straight to the same bucket."""
    s = MinioStore(minio_server.endpoint, minio_server.access_key, minio_server.secret_key,
                   bucket)
    yield s
    s.close()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[SQLiteStore]:
    s = SQLiteStore(tmp_path / "store.sqlite")
    yield s
    s.close()


@pytest.fixture
def tiered(local: SQLiteStore, remote: MinioStore) -> TieredStore:
    return TieredStore([local, remote])


# -- with MinIO as the shared tier ---------------------------------------------------------
@pytest.mark.integration
def test_remote_hit_is_copied_into_the_local_tier(tiered: TieredStore, local: SQLiteStore,
                                                  other_machine: MinioStore,
                                                  pool: CountingPool) -> None:
    other_machine.put(NS, art(key(1), b"compiled elsewhere", host="node-2"), source=LOW)
    assert local.get(NS, key(1)) is None
    got = tiered.get(NS, key(1))
    assert got is not None and got.binary == b"compiled elsewhere"
    copy = local.get(NS, key(1))
    assert copy is not None and copy.meta == got.meta  # host, log, digest: all kept
    # a cache fill never indexes: the local index holds only sources lowered here
    assert local.find_source(NS, SRC) is None
    assert tiered.find_source(NS, SRC) == key(1)
    pool.reset()
    again = tiered.get(NS, key(1))
    assert again is not None and again.binary == b"compiled elsewhere"
    assert pool.requests == []  # the second read never left the machine


@pytest.mark.integration
def test_put_writes_through(tiered: TieredStore, local: SQLiteStore,
                            remote: MinioStore) -> None:
    assert tiered.put(NS, art(key(1), b"mine")) is PutResult.STORED
    for tier in (local, remote):
        got = tier.get(NS, key(1))
        assert got is not None and got.binary == b"mine"
    assert tiered.put(NS, art(key(1), b"mine")) is PutResult.SAME
    assert tiered.stats.refused == 0


@pytest.mark.integration
def test_refused_write_leaves_the_winner_locally(tiered: TieredStore, local: SQLiteStore,
                                                 other_machine: MinioStore,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    other_machine.put(NS, art(key(1), b"winner"))
    with caplog.at_level(logging.INFO):
        assert tiered.put(NS, art(key(1), b"loser")) is PutResult.REFUSED
    assert "first writer wins" in caplog.text
    got = local.get(NS, key(1))
    assert got is not None and got.binary == b"winner"
    tiered_got = tiered.get(NS, key(1))
    assert tiered_got is not None and tiered_got.binary == b"winner"
    assert tiered.stats.refused == 1  # counted once, by the shared tier
    assert tiered.tiers[-1].stats.refused == 1 and local.stats.refused == 0


@pytest.mark.integration
def test_local_value_that_disagrees_is_replaced_on_put(tiered: TieredStore,
                                                       local: SQLiteStore,
                                                       other_machine: MinioStore) -> None:
    """A local tier filled before the shared one knew the key (e.g. an embedded store
    later joined to a cluster) holds another value: a put settles it on the winner's."""
    local.put(NS, art(key(1), b"local from before"))
    other_machine.put(NS, art(key(1), b"shared winner"))
    assert tiered.put(NS, art(key(1), b"a third"), source=LOW) is PutResult.REFUSED
    got = local.get(NS, key(1))
    assert got is not None and got.binary == b"shared winner"
    assert local.find_source(NS, SRC) is None  # the winner's metadata is not ours to index


@pytest.mark.integration
def test_corrupt_local_copy_falls_through_to_the_remote(tiered: TieredStore,
                                                        local: SQLiteStore,
                                                        tmp_path: Path) -> None:
    tiered.put(NS, art(key(1), b"good bytes"))
    corrupt_sqlite(tmp_path / "store.sqlite", key(1))
    got = tiered.get(NS, key(1))
    assert got is not None and got.binary == b"good bytes"
    assert local.stats.corrupt == 1 and local.stats.repaired == 1
    assert tiered.stats.corrupt == 1 and tiered.stats.repaired == 1
    fixed = local.get(NS, key(1))
    assert fixed is not None and fixed.binary == b"good bytes"


@pytest.mark.integration
def test_existing_is_the_union_and_asks_the_remote_only_for_what_is_missing(
        tiered: TieredStore, local: SQLiteStore, other_machine: MinioStore,
        pool: CountingPool) -> None:
    local.put(NS, art(key(1)))
    other_machine.put(NS, art(key(2)))
    tiered.put(NS, art(key(3)))
    assert tiered.existing(NS, [key(1), key(2), key(3), key(4)]) == {key(1), key(2), key(3)}
    pool.reset()
    assert tiered.existing(NS, [key(1), key(3)]) == {key(1), key(3)}
    assert pool.requests == []
    assert list(tiered.keys(NS)) == [key(1), key(2), key(3)]
    assert tiered.namespaces() == [NS]


@pytest.mark.integration
def test_find_source_delete_and_rekey_through_the_tiers(tiered: TieredStore,
                                                        local: SQLiteStore,
                                                        remote: MinioStore,
                                                        other_machine: MinioStore) -> None:
    low = lowered("a")
    src = low.source_hash
    other_machine.put(NS, art(key(1), b"x", src), source=low)
    assert tiered.find_source(NS, src) == key(1)  # the local tier has no entry: remote
    moved = tiered.rekey(NS, key(1), key(1, "b2b2b2b2"), move=True, source=low)
    assert moved is not None and moved.meta.key == key(1, "b2b2b2b2")
    for tier in (local, remote):
        assert tier.get(NS, key(1)) is None
        got = tier.get(NS, key(1, "b2b2b2b2"))
        assert got is not None and got.binary == b"x"
        assert tier.find_source(NS, src) == key(1, "b2b2b2b2")
    tiered.delete(NS, key(1, "b2b2b2b2"))
    for tier in (local, remote):
        assert tier.get(NS, key(1, "b2b2b2b2")) is None
        assert tier.find_source(NS, src) is None
    assert tiered.namespaces() == []


@pytest.mark.integration
def test_location_and_repr_name_the_tiers_without_credentials(
        tiered: TieredStore, local: SQLiteStore, remote: MinioStore,
        minio_server: MinioServer) -> None:
    assert tiered.location == f"{local.location} -> {remote.location}"
    assert minio_server.secret_key not in repr(tiered) + tiered.location


# -- the tier rules, with in-memory tiers --------------------------------------------------
class _FailingFill(MemoryStore):
    """A front tier whose writes fail (a full disk)."""

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        raise OSError(28, "No space left on device")


def test_a_failed_fill_does_not_fail_the_read_or_write(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    shared = MemoryStore()
    store = TieredStore([_FailingFill(), shared])
    shared.put(NS, art(key(1), b"x"))
    with caplog.at_level(logging.WARNING):
        got = store.get(NS, key(1))
        assert store.put(NS, art(key(2), b"y")) is PutResult.STORED
    assert got is not None and got.binary == b"x"
    assert "No space left on device" in caplog.text
    assert shared.get(NS, key(2)) is not None


def test_three_tiers_fill_every_front_tier() -> None:
    memory, local, shared = MemoryStore(), MemoryStore(), MemoryStore()
    store = TieredStore([memory, local, shared])
    shared.put(NS, art(key(1), b"x"))
    assert store.get(NS, key(1)) is not None
    assert memory.get(NS, key(1)) is not None and local.get(NS, key(1)) is not None
    assert store.get(OTHER_NS, key(1)) is None
    store.close()


def test_a_winner_gone_corrupt_is_not_kept_locally() -> None:
    """When the shared tier refuses but then cannot serve its winner, the front tier
    keeps nothing rather than a value the shared tier does not hold."""

    class RefusesThenMisses(MemoryStore):
        def put(self, ns: Namespace, artifact: Artifact, *,
                source: Lowered | None = None) -> PutResult:
            return PutResult.REFUSED

        def get(self, ns: Namespace, key: Key) -> Artifact | None:
            return None

    front = MemoryStore()
    front.put(NS, art(key(1), b"stale"))
    store = TieredStore([front, RefusesThenMisses()])
    assert store.put(NS, art(key(1), b"new")) is PutResult.REFUSED
    assert front.get(NS, key(1)) is None


def test_tiered_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])


def test_memory_store_keeps_the_rules() -> None:
    store: ArtifactStore = MemoryStore()
    assert store.put(NS, art(key(1), b"first"), source=LOW) is PutResult.STORED
    assert store.put(NS, art(key(1), b"first")) is PutResult.SAME
    assert store.put(NS, art(key(1), b"second")) is PutResult.REFUSED
    assert store.stats.refused == 1
    assert store.existing(NS, [key(1), key(2)]) == {key(1)}
    assert store.find_source(NS, SRC) == key(1)
    moved = store.rekey(NS, key(1), key(1, "b2b2b2b2"), move=True, source=LOW)
    assert moved is not None and store.get(NS, key(1)) is None
    assert store.find_source(NS, SRC) == key(1, "b2b2b2b2")
    assert store.namespaces() == [NS] and list(store.keys(NS)) == [key(1, "b2b2b2b2")]


def test_memory_store_corrupt_entry_is_a_miss_and_repaired() -> None:
    store = MemoryStore()
    good = art(key(1), b"good bytes")
    store.put(NS, good)
    store._items[(NS, key(1))] = Artifact(meta=good.meta, binary=b"evil bytes")
    assert store.get(NS, key(1)) is None
    assert store.stats.corrupt == 1
    assert store.put(NS, good) is PutResult.STORED and store.stats.repaired == 1
    assert store.get(NS, key(1)) is not None


def test_memory_store_evicts_least_recently_used() -> None:
    store = MemoryStore(max_bytes=20)
    for i in range(3):
        low = lowered(str(i))
        store.put(NS, art(key(i), bytes(8), source=low.source_hash), source=low)
    assert store.existing(NS, [key(0), key(1), key(2)]) == {key(1), key(2)}
    assert store.find_source(NS, lowered("0").source_hash) is None  # went with it
    assert store.find_source(NS, lowered("1").source_hash) == key(1)
    store.get(NS, key(1))  # key 1 is now the most recently used
    store.put(NS, art(key(3), bytes(8), source=lowered("3").source_hash))
    assert store.existing(NS, [key(1), key(2), key(3)]) == {key(1), key(3)}
