"""Every store backend through the same cases: the rules of ``farm.store.base``.

Each backend is opened the one way a process opens a store (``open_store``, from the URL
of ``FARM_STORE_URL``): memory, SQLite, MinIO (the real server of the test session) and
the tiered store as a cluster's process has it (SQLite in front of MinIO). A new backend
joins :data:`URLS` and passes these before it is done (CONTRIBUTING.md, "Adding a store
backend").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.core.settings import Settings
from farm.devservices import MinioServer
from farm.store import ArtifactStore, PutResult
from farm.store.open import BACKENDS, open_store

NS = Namespace.for_fingerprint("pocl-contract-device-0123456789ab")
OTHER = Namespace.for_fingerprint("nvidia-contract-device-0123456789ab")

MakeURL = Callable[[Path, MinioServer | None], str]


def _minio(server: MinioServer | None) -> str:
    assert server is not None
    return f"minio://{server.endpoint}/c-{uuid.uuid4().hex[:16]}" + \
        ("?secure=true" if server.secure else "")


#: a scheme of each backend -> (its URL in a fresh place, whether it needs MinIO)
URLS: dict[str, tuple[MakeURL, bool]] = {
    "memory": (lambda tmp, _: "memory://", False),
    "sqlite": (lambda tmp, _: f"sqlite://{tmp / 'store.sqlite'}", False),
    "minio": (lambda tmp, server: _minio(server), True),
    "tiered": (lambda tmp, server: f"tiered:sqlite://{tmp / 'local.sqlite'}|{_minio(server)}",
               True),
}


@pytest.fixture(params=sorted(URLS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArtifactStore]:
    make, needs_minio = URLS[request.param]
    server: MinioServer | None = request.getfixturevalue("minio_server") if needs_minio \
        else None
    settings = Settings(home=tmp_path / "home", store_url=make(tmp_path, server),
                        minio_access_key=server.access_key if server else None,
                        minio_secret_key=server.secret_key if server else None)
    opened = open_store(settings)
    yield opened
    opened.close()


def lowered(text: str) -> Lowered:
    return Lowered(source=text, kernel_names=("k",))


def key(i: int, build: str = "b1b1b1b1") -> Key:
    return Key(id_hash=f"{i:032x}", build_id=build)


def art(k: Key, payload: bytes = b"binary", source: Lowered | None = None) -> Artifact:
    return Artifact.create(k, "fam", payload, (source or lowered("k")).source_hash)


def test_every_backend_of_the_registry_is_in_the_contract() -> None:
    """:data:`URLS` is keyed by scheme: one scheme of every backend class runs the cases."""
    assert {BACKENDS[scheme] for scheme in URLS} == set(BACKENDS.values())


def test_put_then_get_in_its_namespace_only(store: ArtifactStore) -> None:
    a = art(key(1), b"\x00payload\xff")
    assert store.put(NS, a) is PutResult.STORED
    got = store.get(NS, key(1))
    assert got is not None and got.binary == a.binary and got.meta.digest == a.meta.digest
    assert got.meta.key == key(1) and got.meta.family == "fam"
    assert store.get(NS, key(2)) is None
    assert store.get(OTHER, key(1)) is None
    assert store.existing(NS, [key(1), key(2)]) == {key(1)}
    assert store.existing(OTHER, [key(1)]) == set()


def test_first_writer_wins(store: ArtifactStore) -> None:
    assert store.put(NS, art(key(1), b"first")) is PutResult.STORED
    assert store.put(NS, art(key(1), b"second")) is PutResult.REFUSED
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"first"
    assert store.stats.refused == 1


def test_the_same_value_again_is_fine(store: ArtifactStore) -> None:
    a = art(key(1))
    assert store.put(NS, a) is PutResult.STORED
    assert store.put(NS, a) is PutResult.SAME
    assert store.stats.refused == 0


def test_a_value_that_fails_its_digest_is_a_miss_and_a_put_repairs_it(
        store: ArtifactStore) -> None:
    good = art(key(1), b"the real bytes")
    damaged = Artifact(meta=good.meta, binary=b"the real byteZ")
    store.put(NS, damaged)
    assert store.get(NS, key(1)) is None
    assert store.stats.corrupt >= 1
    assert store.put(NS, good) is PutResult.STORED  # a corrupt value is not a value
    got = store.get(NS, key(1))
    assert got is not None and got.binary == good.binary


def test_the_source_index_holds_only_what_a_writer_lowered(store: ArtifactStore) -> None:
    low = lowered("__kernel void k(global int *x) { x[0] = 1; }")
    store.put(NS, art(key(1), source=low), source=low)
    assert store.find_source(NS, low.source_hash) == key(1)
    assert store.find_source(OTHER, low.source_hash) is None
    other = lowered("__kernel void k(global int *x) { x[0] = 2; }")
    store.put(NS, art(key(2), source=other))  # no source: not indexed
    assert store.find_source(NS, other.source_hash) is None


def test_delete_takes_the_artifact_and_its_index_entry(store: ArtifactStore) -> None:
    low = lowered("__kernel void k(global int *x) { x[0] = 3; }")
    store.put(NS, art(key(1), source=low), source=low)
    store.put(NS, art(key(2)))
    store.delete(NS, key(1))
    assert store.get(NS, key(1)) is None and store.existing(NS, [key(1)]) == set()
    assert store.find_source(NS, low.source_hash) is None
    assert store.get(NS, key(2)) is not None
    store.delete(NS, key(9))  # not there: nothing happens


def test_keys_list_a_namespace_in_order(store: ArtifactStore) -> None:
    for k in (key(3), key(1, "c2c2c2c2"), key(1), key(2)):
        store.put(NS, art(k, str(k).encode()))
    store.put(OTHER, art(key(7)))
    assert list(store.keys(NS)) == [key(1), key(1, "c2c2c2c2"), key(2), key(3)]
    assert list(store.keys(OTHER)) == [key(7)]


def test_namespaces_are_those_that_hold_an_artifact(store: ArtifactStore) -> None:
    assert store.namespaces() == []
    store.put(NS, art(key(1)))
    store.put(OTHER, art(key(2)))
    assert store.namespaces() == sorted([NS, OTHER], key=str)
    store.delete(OTHER, key(2))
    assert store.namespaces() == [NS]


def test_rekey_copies_and_moves_under_first_writer_wins(store: ArtifactStore) -> None:
    low = lowered("__kernel void k(global int *x) { x[0] = 4; }")
    store.put(NS, art(key(1), b"shared", source=low), source=low)
    assert store.rekey(NS, key(1), key(2), move=False, source=low) is not None
    assert store.get(NS, key(1)) is not None
    got = store.get(NS, key(2))
    assert got is not None and got.binary == b"shared" and got.meta.key == key(2)
    assert store.rekey(NS, key(2), key(3), move=True, source=low) is not None
    assert store.get(NS, key(2)) is None and store.get(NS, key(3)) is not None
    assert store.find_source(NS, low.source_hash) == key(3)


def test_blobs_are_content_addressed(store: ArtifactStore) -> None:
    digest = store.put_blob(b"#define N 4\n")
    assert store.put_blob(b"#define N 4\n") == digest
    assert store.get_blob(digest) == b"#define N 4\n"
    assert store.existing_blobs([digest, "0" * 64]) == {digest}
    assert store.get_blob("1" * 64) is None


def test_a_quarantined_artifact_is_set_aside_with_why(store: ArtifactStore) -> None:
    a = art(key(1), b"crashes the driver")
    store.put(NS, a)
    assert store.quarantine(NS, key(1), "f" * 64, "not its digest") is False
    assert store.quarantine(NS, key(1), a.meta.digest, "the device\nrefused it") is True
    assert store.get(NS, key(1)) is None
    held = store.quarantined(NS)  # a tiered store: each tier's evidence
    assert held and {(q.key, q.artifact.binary, q.reason) for q in held} == \
        {(key(1), a.binary, "the device refused it")}
    assert store.put(NS, art(key(1), b"the repair")) is PutResult.STORED


def test_the_probe_answers(store: ArtifactStore) -> None:
    store.probe(NS)  # raises StoreError when the store does not answer
    assert store.namespaces() == []  # and writes nothing
