"""The MinIO store against a real MinIO: first writer wins through conditional writes,
integrity, the source index, bulk look-ups in one listing, retries, no credentials shown.

Every test works in a bucket of its own, so they stay independent of each other and of
the order they run in.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import urllib3
from minio import Minio
from minio.error import S3Error

from farm.core.errors import SettingsError, StoreError
from farm.core.keys import Namespace, artifact_object, source_object
from farm.core.model import Artifact, Key, Lowered
from farm.core.settings import Settings
from farm.devservices import MinioServer
from farm.devservices.ports import LOOPBACK, free_port
from farm.store import PutResult, SQLiteStore, TieredStore, open_store
from farm.store.minio import MAGIC, MinioStore, Retry, encode_artifact

pytestmark = pytest.mark.integration

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
    """A connection pool that counts the HTTP requests the SDK sends through it and can
    fail the first ones the way a flaky network or a busy server does."""

    def __init__(self, fail_first: list[str] | None = None) -> None:
        super().__init__(retries=False, timeout=urllib3.Timeout(connect=5, read=30))
        self.requests: list[tuple[str, str]] = []
        self.failures = list(fail_first or [])
        self._lock = threading.Lock()

    def urlopen(self, method: str, url: str, redirect: bool = True,  # type: ignore[override]
                **kw: Any) -> urllib3.BaseHTTPResponse:  # (PoolManager's own signature)
        with self._lock:
            self.requests.append((method, url))
            failure = self.failures.pop(0) if self.failures else None
        if failure == "reset":
            raise urllib3.exceptions.ProtocolError("Connection aborted.",
                                                   ConnectionResetError(104, "reset"))
        if failure == "slowdown":
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>")
            return urllib3.HTTPResponse(body=io.BytesIO(body), status=503,
                                        headers={"Content-Type": "application/xml"},
                                        preload_content=False)
        return super().urlopen(method, url, redirect=redirect, **kw)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()


def new_bucket() -> str:
    return f"farm-test-{uuid.uuid4().hex[:16]}"


def make_store(server: MinioServer, bucket: str, **kw: Any) -> MinioStore:
    return MinioStore(server.endpoint, server.access_key, server.secret_key, bucket,
                      secure=server.secure, **kw)


@pytest.fixture
def bucket() -> str:
    return new_bucket()


@pytest.fixture
def pool() -> CountingPool:
    return CountingPool()


@pytest.fixture
def store(minio_server: MinioServer, bucket: str, pool: CountingPool) -> Iterator[MinioStore]:
    s = make_store(minio_server, bucket, http_client=pool)
    yield s
    s.close()


@pytest.fixture
def raw(minio_server: MinioServer) -> Minio:
    """The plain SDK, to look at and tamper with objects behind the store's back."""
    return Minio(minio_server.endpoint, minio_server.access_key, minio_server.secret_key,
                 secure=minio_server.secure)


def overwrite(raw: Minio, bucket: str, name: str, data: bytes) -> None:
    raw.put_object(bucket, name, io.BytesIO(data), len(data))


def exists(raw: Minio, bucket: str, name: str) -> bool:
    try:
        raw.stat_object(bucket, name)
    except S3Error as exc:
        assert exc.code == "NoSuchKey"
        return False
    return True


# -- basics --------------------------------------------------------------------------------
def test_creates_bucket_and_roundtrips_full_metadata(store: MinioStore, raw: Minio,
                                                     bucket: str) -> None:
    assert raw.bucket_exists(bucket)
    long_log = "warning: something long\n" * 400  # ~10 KiB: more than S3 user metadata
    a = art(key(1), b"\x00\x01binary", build_log=long_log, host="node-7", worker="w-3",
            work_s=0.087)
    assert store.put(NS, a) is PutResult.STORED
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"\x00\x01binary"
    assert got.meta == a.meta  # build log, host, worker, work time, created_at: all kept
    headers = raw.stat_object(bucket, artifact_object(NS, key(1))).metadata
    assert headers is not None
    assert headers["x-amz-meta-farm-digest"] == a.meta.digest
    assert headers["x-amz-meta-farm-size"] == str(a.meta.size)
    assert headers["x-amz-meta-farm-build-id"] == "b1b1b1b1"
    assert headers["x-amz-meta-farm-source-hash"] == SRC
    assert headers["x-amz-meta-farm-family"] == "fam"
    assert headers["x-amz-meta-farm-host"] == "node-7"
    assert headers["x-amz-meta-farm-worker"] == "w-3"
    assert float(headers["x-amz-meta-farm-work-s"]) == pytest.approx(0.087)
    body = raw.get_object(bucket, artifact_object(NS, key(1))).read()
    assert body.startswith(MAGIC) and body.endswith(b"\x00\x01binary")


def test_namespaces_are_separate(store: MinioStore, raw: Minio, bucket: str) -> None:
    assert store.put(NS, art(key(1), b"for pocl")) is PutResult.STORED
    assert store.get(OTHER_NS, key(1)) is None
    assert store.existing(OTHER_NS, [key(1)]) == set()
    assert store.put(OTHER_NS, art(key(1), b"for nvidia")) is PutResult.STORED
    got_ns, got_other = store.get(NS, key(1)), store.get(OTHER_NS, key(1))
    assert got_ns is not None and got_ns.binary == b"for pocl"
    assert got_other is not None and got_other.binary == b"for nvidia"
    assert store.existing(NS, [key(1), key(2)]) == {key(1)}
    # objects of another layout in the bucket are not namespaces
    overwrite(raw, bucket, "README.txt", b"hello")
    overwrite(raw, bucket, "opencl/v1/NOT A FINGERPRINT/artifacts/x/y", b"hello")
    assert store.namespaces() == sorted([NS, OTHER_NS], key=str)
    assert list(store.keys(NS)) == [key(1)]


def test_keys_lists_a_namespace_in_order(store: MinioStore) -> None:
    for i in (3, 1, 2):
        store.put(NS, art(key(i), bytes([i])))
    store.put(NS, art(key(1, "b2b2b2b2"), b"rebuilt"))
    assert list(store.keys(NS)) == [key(1), key(1, "b2b2b2b2"), key(2), key(3)]
    assert list(store.keys(OTHER_NS)) == []


# -- first writer wins ---------------------------------------------------------------------
def test_first_writer_wins(store: MinioStore, caplog: pytest.LogCaptureFixture) -> None:
    assert store.put(NS, art(key(1), b"first")) is PutResult.STORED
    assert store.put(NS, art(key(1), b"first")) is PutResult.SAME
    with caplog.at_level(logging.INFO):
        assert store.put(NS, art(key(1), b"second")) is PutResult.REFUSED
    assert store.stats.refused == 1
    assert "first writer wins" in caplog.text
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"first"


def test_racing_writers_exactly_one_wins(minio_server: MinioServer, bucket: str) -> None:
    """Two workers (two clients) put different values for the same keys at the same
    moment; for every key exactly one is stored and the other refused."""
    workers = [make_store(minio_server, bucket) for _ in range(2)]
    rounds = 12
    barrier = threading.Barrier(2)

    def race(w: int) -> list[PutResult]:
        results = []
        for i in range(rounds):
            barrier.wait()
            results.append(workers[w].put(NS, art(key(i), f"worker {w}".encode())))
        return results

    with ThreadPoolExecutor(2) as ex:
        a, b = ex.map(race, [0, 1])
    for i in range(rounds):
        assert sorted([a[i], b[i]]) == sorted([PutResult.STORED, PutResult.REFUSED]), i
        winner = 0 if a[i] is PutResult.STORED else 1
        got = workers[0].get(NS, key(i))
        assert got is not None and got.binary == f"worker {winner}".encode()
    assert workers[0].stats.refused + workers[1].stats.refused == rounds


# -- integrity -----------------------------------------------------------------------------
def test_corrupt_object_is_a_miss_and_put_repairs_it(store: MinioStore, raw: Minio,
                                                     bucket: str) -> None:
    good = art(key(1), b"good bytes")
    store.put(NS, good)
    tampered = bytearray(encode_artifact(good))
    tampered[-1] ^= 0xFF  # one flipped bit in the binary: frame intact, digest wrong
    overwrite(raw, bucket, artifact_object(NS, key(1)), bytes(tampered))
    assert store.get(NS, key(1)) is None
    assert store.stats.corrupt == 1
    assert key(1) in store.existing(NS, [key(1)])  # present, but not served
    assert store.put(NS, good) is PutResult.STORED
    assert store.stats.repaired == 1
    got = store.get(NS, key(1))
    assert got is not None and got.binary == b"good bytes"
    assert store.stats.corrupt == 1


GOOD = art(key(1), b"good bytes")


@pytest.mark.parametrize("content", [
    pytest.param(b"", id="empty"),
    pytest.param(b"garbage" * 50, id="garbage"),
    pytest.param(MAGIC + b"\x00\x00", id="truncated-header"),
    pytest.param(MAGIC + b"\x00\x00\xff\xff{}", id="length-past-end"),
    pytest.param(MAGIC + b"\x00\x00\x00\x02{}good bytes", id="invalid-metadata"),
    pytest.param(encode_artifact(GOOD)[:-3], id="truncated-binary"),
    pytest.param(encode_artifact(art(key(99), b"good bytes")), id="another-keys-frame"),
])
def test_unreadable_object_is_a_miss_not_an_exception(store: MinioStore, raw: Minio,
                                                      bucket: str, content: bytes) -> None:
    good = GOOD
    name = artifact_object(NS, key(1))
    overwrite(raw, bucket, name, content)
    # an empty object is a deleted key (farm.store.minio_removal): a miss, not damage
    damaged = int(content != b"")
    assert store.get(NS, key(1)) is None
    assert store.stats.corrupt == damaged
    assert store.put(NS, good) is PutResult.STORED  # put repairs it
    assert store.stats.repaired == damaged
    got = store.get(NS, key(1))
    assert got is not None and got.meta == good.meta


def test_header_digest_disagreeing_with_the_frame_is_corrupt(store: MinioStore, raw: Minio,
                                                             bucket: str) -> None:
    good = art(key(1), b"good bytes")
    body = encode_artifact(good)
    raw.put_object(bucket, artifact_object(NS, key(1)), io.BytesIO(body), len(body),
                   metadata={"farm-digest": "0" * 64})
    assert store.get(NS, key(1)) is None
    assert store.stats.corrupt == 1


def test_concurrent_repairs_of_one_corrupt_object_store_once(
        minio_server: MinioServer, raw: Minio, bucket: str) -> None:
    """Repairs overwrite only the corrupt object they read (If-Match on its etag), so two
    repairs with different values cannot both win."""
    workers = [make_store(minio_server, bucket) for _ in range(2)]
    overwrite(raw, bucket, artifact_object(NS, key(1)), b"garbage")
    barrier = threading.Barrier(2)

    def repair(w: int) -> PutResult:
        barrier.wait()
        return workers[w].put(NS, art(key(1), f"worker {w}".encode()))

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(repair, [0, 1]))
    assert sorted(results) == sorted([PutResult.STORED, PutResult.REFUSED])
    winner = results.index(PutResult.STORED)
    got = workers[0].get(NS, key(1))
    assert got is not None and got.binary == f"worker {winner}".encode()


# -- source index and rekey ----------------------------------------------------------------
def test_source_index_and_rekey_copy_and_move(store: MinioStore, raw: Minio,
                                              bucket: str) -> None:
    low = lowered("a")
    src = low.source_hash
    store.put(NS, art(key(1, "b1b1b1b1"), b"x", src), source=low)
    assert store.find_source(NS, src) == key(1, "b1b1b1b1")
    index = raw.get_object(bucket, source_object(NS, src)).read()
    assert index == str(key(1, "b1b1b1b1")).encode()  # the index entry is the key text
    assert store.find_source(NS, "f" * 64) is None

    copied = store.rekey(NS, key(1, "b1b1b1b1"), key(2, "b1b1b1b1"), move=False, source=low)
    assert copied is not None and copied.meta.key == key(2, "b1b1b1b1")
    assert store.get(NS, key(1, "b1b1b1b1")) is not None
    got = store.get(NS, key(2, "b1b1b1b1"))
    assert got is not None and got.binary == b"x" and got.meta.key == key(2, "b1b1b1b1")

    moved = store.rekey(NS, key(2, "b1b1b1b1"), key(2, "b2b2b2b2"), move=True, source=low)
    assert moved is not None and moved.meta.key == key(2, "b2b2b2b2")
    assert store.get(NS, key(2, "b1b1b1b1")) is None
    assert not exists(raw, bucket, artifact_object(NS, key(2, "b1b1b1b1")))
    assert store.find_source(NS, src) == key(2, "b2b2b2b2")
    assert store.rekey(NS, key(7), key(8), move=True) is None  # nothing to rekey


def test_rekey_onto_a_taken_key_keeps_the_first_writer(store: MinioStore) -> None:
    store.put(NS, art(key(1), b"one", lowered("a").source_hash))
    store.put(NS, art(key(2), b"two", lowered("b").source_hash))
    kept = store.rekey(NS, key(1), key(2), move=False)
    assert kept is not None and kept.binary == b"two"
    assert store.stats.refused == 1


def test_delete_removes_the_object_and_its_index_entry(store: MinioStore, raw: Minio,
                                                       bucket: str) -> None:
    low = lowered("c")
    src = low.source_hash
    store.put(NS, art(key(1), b"x", src), source=low)
    store.delete(NS, key(1))
    assert not exists(raw, bucket, artifact_object(NS, key(1)))
    assert not exists(raw, bucket, source_object(NS, src))
    assert store.find_source(NS, src) is None
    assert store.namespaces() == []
    store.delete(NS, key(1))  # deleting what is gone is fine


def test_delete_keeps_an_index_entry_that_points_elsewhere(store: MinioStore) -> None:
    low = lowered("d")
    src = low.source_hash
    store.put(NS, art(key(1), b"x", src), source=low)
    store.put(NS, art(key(2), b"x", src), source=low)  # the index now points at key 2
    store.delete(NS, key(1))
    assert store.find_source(NS, src) == key(2)


# -- bulk look-up --------------------------------------------------------------------------
def test_existing_on_500_keys_is_one_listing(store: MinioStore, pool: CountingPool) -> None:
    held = [key(i) for i in range(500)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        assert set(ex.map(lambda k: store.put(NS, art(k, k.id_hash.encode())), held)) \
            == {PutResult.STORED}
    fill_s = time.perf_counter() - t0
    absent = [key(i) for i in range(500, 600)]
    pool.reset()
    t0 = time.perf_counter()
    assert store.existing(NS, held + absent) == set(held)
    bulk_s = time.perf_counter() - t0
    assert len(pool.requests) == 1, pool.requests
    method, url = pool.requests[0]
    assert method == "GET" and "list-type=2" in url
    assert bulk_s < fill_s
    pool.reset()
    assert store.existing(NS, []) == set()
    assert pool.requests == []  # nothing asked, nothing sent


# -- retries and failures ------------------------------------------------------------------
def test_transient_errors_are_retried(minio_server: MinioServer, bucket: str) -> None:
    flaky = CountingPool(fail_first=["reset", "slowdown"])
    s = make_store(minio_server, bucket, http_client=flaky, retry=Retry(wait_s=0.01))
    assert len(flaky.requests) >= 3  # two failures, then the bucket check went through
    flaky.failures = ["slowdown", "reset"]
    assert s.put(NS, art(key(1), b"x")) is PutResult.STORED
    flaky.failures = ["reset", "reset"]
    got = s.get(NS, key(1))
    assert got is not None and got.binary == b"x"
    flaky.failures = ["slowdown"] * 10  # outlasts the retries: a StoreError, not a hang
    with pytest.raises(StoreError, match="SlowDown"):
        s.get(NS, key(1))
    s.close()


def test_client_errors_are_not_retried(minio_server: MinioServer, bucket: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    wrong_secret = "not-the-secret-" + uuid.uuid4().hex
    counting = CountingPool()
    with caplog.at_level(logging.DEBUG), pytest.raises(StoreError) as info:
        MinioStore(minio_server.endpoint, minio_server.access_key, wrong_secret, bucket,
                   http_client=counting, retry=Retry(wait_s=0.5))
    assert len(counting.requests) == 1  # a 403 is answered at once, never repeated
    assert "SignatureDoesNotMatch" in str(info.value) or "AccessDenied" in str(info.value)
    assert wrong_secret not in str(info.value) and wrong_secret not in caplog.text


class _LateForwarder:
    """A TCP port with nothing behind it until ``delay_s`` has passed, then a forwarder to
    MinIO: a store that is pointed at a server still coming up."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.port = free_port()
        self.target_port = target_port
        self.delay_s = delay_s
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._stop.wait(self.delay_s):
            return
        listener = socket.create_server((LOOPBACK, self.port))
        listener.settimeout(0.2)
        self._listener = listener
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection((LOOPBACK, self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
        listener.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_a_server_that_comes_up_within_the_retry_window(minio_server: MinioServer,
                                                        bucket: str) -> None:
    late = _LateForwarder(minio_server.port, delay_s=0.5)
    try:
        t0 = time.perf_counter()
        s = MinioStore(f"{LOOPBACK}:{late.port}", minio_server.access_key,
                       minio_server.secret_key, bucket, retry=Retry(attempts=8, wait_s=0.1))
        assert time.perf_counter() - t0 >= 0.4  # it really waited for the server
        assert s.put(NS, art(key(1))) is PutResult.STORED
        s.close()
    finally:
        late.close()


def test_unreachable_store_fails_with_its_location(bucket: str) -> None:
    port = free_port()  # nothing listens here
    with pytest.raises(StoreError, match=f"minio://{LOOPBACK}:{port}/{bucket}"):
        MinioStore(f"{LOOPBACK}:{port}", "user", "password", bucket,
                   retry=Retry(attempts=2, wait_s=0.01))


# -- credentials and settings --------------------------------------------------------------
def test_credentials_never_appear(store: MinioStore, minio_server: MinioServer,
                                  bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        store.put(NS, art(key(1), b"one"))
        store.put(NS, art(key(1), b"two"))
    assert store.location == f"minio://{minio_server.endpoint}/{bucket}"
    for text in (repr(store), store.location, str(store), caplog.text):
        assert minio_server.secret_key not in text
        assert minio_server.access_key not in text


def test_open_store_follows_settings(minio_server: MinioServer, tmp_path: Path,
                                     bucket: str) -> None:
    plain = open_store(Settings(home=tmp_path, minio_endpoint=None))
    assert isinstance(plain, SQLiteStore)
    plain.close()
    settings = Settings(home=tmp_path, minio_endpoint=f"http://{minio_server.endpoint}",
                        minio_access_key=minio_server.access_key,
                        minio_secret_key=minio_server.secret_key, minio_bucket=bucket)
    tiered = open_store(settings)
    try:
        assert isinstance(tiered, TieredStore)
        local, remote = tiered.tiers
        assert isinstance(local, SQLiteStore) and local.path == settings.store_path
        assert isinstance(remote, MinioStore)
        assert remote.location == f"minio://{minio_server.endpoint}/{bucket}"
        assert remote.secure is False
        assert minio_server.secret_key not in repr(tiered) + tiered.location
        assert tiered.put(NS, art(key(1))) is PutResult.STORED
    finally:
        tiered.close()
    no_keys = Settings(home=tmp_path, minio_endpoint=minio_server.endpoint,
                       minio_access_key=None, minio_secret_key=None)
    with pytest.raises(SettingsError, match="FARM_MINIO_ACCESS_KEY"):
        open_store(no_keys)
    bad = Settings(home=tmp_path, minio_endpoint="ftp://host:9000/x",
                   minio_access_key="a", minio_secret_key="b")
    with pytest.raises(SettingsError, match="FARM_MINIO_ENDPOINT"):
        open_store(bad)
