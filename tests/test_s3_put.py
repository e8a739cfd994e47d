"""The store's writes without the SDK (``farm.store.s3_put``), against a real MinIO:
conditional writes answer as the SDK's do, the store's rules hold through them, a
connection the server dropped is replaced unseen, and what is not an answer (nothing
listening, silence, a proxy's page, a broken answer) is an outage or an error in one
line, never a hang. ``FARM_MINIO_REGION``: a store that is given the region never asks
for it, and a wrong one is said by name.
"""

from __future__ import annotations

import io
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from minio import Minio
from minio.error import InvalidResponseError, S3Error
from test_connection_errors import self_signed
from test_store_minio import NS, CountingPool, art, key, lowered, make_store, new_bucket

from farm.core.errors import StoreError
from farm.core.keys import artifact_object, source_object
from farm.core.outage import refusal
from farm.core.settings import Settings
from farm.devservices import MinioServer
from farm.devservices.ports import LOOPBACK
from farm.store import PutResult
from farm.store.minio import MinioStore
from farm.store.open import open_store
from farm.store.s3_failures import ClientOptions, describe, is_transient
from farm.store.s3_put import S3Writer
from farm.store.s3_request import S3Unreachable

pytestmark = pytest.mark.integration


@pytest.fixture
def bucket(minio_server: MinioServer) -> str:
    name = new_bucket()
    raw(minio_server).make_bucket(name)
    return name


def raw(server: MinioServer) -> Minio:
    return Minio(server.endpoint, server.access_key, server.secret_key, secure=False)


def writer(server: MinioServer, bucket: str, **kw: object) -> S3Writer:
    return S3Writer(server.endpoint, False, server.access_key, server.secret_key, bucket,
                    **kw)  # type: ignore[arg-type]


def test_a_put_is_the_object_with_its_headers_and_first_writer_wins(
        minio_server: MinioServer, bucket: str) -> None:
    w = writer(minio_server, bucket)
    sdk = raw(minio_server)
    name = "a/b:c d+e/obj"  # characters a path encodes
    w.put(name, b"first", {"Content-Type": "text/plain", "If-None-Match": "*",
                           "x-amz-meta-farm-host": "host  with   spaces"})
    got = sdk.get_object(bucket, name)
    assert got.read() == b"first" and got.headers["Content-Type"] == "text/plain"
    meta = sdk.stat_object(bucket, name).metadata
    assert meta is not None  # sent as given, signed as S3 reads it:
    assert meta["x-amz-meta-farm-host"] == "host  with   spaces"
    with pytest.raises(S3Error) as taken:  # the name is taken: a 412, as the SDK says it
        w.put(name, b"second", {"If-None-Match": "*"})
    assert taken.value.code == "PreconditionFailed" and not is_transient(taken.value)
    etag = sdk.stat_object(bucket, name).etag
    with pytest.raises(S3Error, match="PreconditionFailed"):
        w.put(name, b"third", {"If-Match": '"not-its-etag"'})
    w.put(name, b"fourth", {"If-Match": f'"{etag}"'})  # exactly what was read: replaced
    assert sdk.get_object(bucket, name).read() == b"fourth"
    with pytest.raises(S3Error) as gone:
        w.put("never-written", b"x", {"If-Match": f'"{etag}"'})
    assert gone.value.code == "NoSuchKey"
    w.close()


@pytest.mark.parametrize("headers", [{"x-amz-meta-farm-host": "a\r\nx-amz-meta-evil: 1"},
                                     {"x-amz-meta-farm-host": "caf\u00e9"},
                                     {"x-amz-meta-evil: 1\r\nx": "v"}, {"": "v"}])
def test_a_header_that_is_not_one_line_of_ascii_is_refused_before_anything_is_sent(
        minio_server: MinioServer, bucket: str, headers: dict[str, str]) -> None:
    w = writer(minio_server, bucket)
    with pytest.raises(ValueError, match="not one line of printable ASCII"):
        w.put("x", b"x", headers)
    assert list(raw(minio_server).list_objects(bucket)) == []


def test_wrong_credentials_are_refused_once_and_never_shown(
        minio_server: MinioServer, bucket: str) -> None:
    secret = "not-the-secret-" + uuid.uuid4().hex
    w = S3Writer(minio_server.endpoint, False, minio_server.access_key, secret, bucket)
    with pytest.raises(S3Error) as refused:
        w.put("x", b"x", {})
    assert refused.value.code == "SignatureDoesNotMatch" and not is_transient(refused.value)
    assert "FARM_MINIO_SECRET_KEY" in describe(refused.value)
    assert secret not in describe(refused.value)


def test_many_threads_write_at_once_each_on_its_connection(
        minio_server: MinioServer, bucket: str) -> None:
    w = writer(minio_server, bucket)
    names = [f"t/{i}" for i in range(64)]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda n: w.put(n, n.encode(), {"If-None-Match": "*"}), names))
    sdk = raw(minio_server)
    assert {o.object_name for o in sdk.list_objects(bucket, "t/", recursive=True)} == \
        set(names)
    assert all(sdk.get_object(bucket, n).read() == n.encode() for n in names[:5])
    w.close()


def test_a_restarted_server_costs_no_failure(tmp_path: Path) -> None:
    """The kept connection dies with the server; the next write opens another."""
    with MinioServer(tmp_path) as server:
        name = new_bucket()
        raw(server).make_bucket(name)
        w = writer(server, name)
        w.put("before", b"1", {})
        server.halt()  # the same server back: its port, data and keys
        server.resume()
        w.put("after", b"2", {})
        assert raw(server).get_object(name, "after").read() == b"2"
        w.close()


# -- what is not an answer --------------------------------------------------------------------
class _Fake:
    """A TCP server on loopback whose every connection ``serve`` handles."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server((LOOPBACK, 0))
        self.endpoint = f"{LOOPBACK}:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self._serve = serve
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            self._serve(conn)

    def close(self) -> None:
        self.listener.close()


def _read_request(conn: socket.socket) -> bool:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return False
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(65536)
    return True


def _answering(*answers: bytes, close: bool = False) -> Callable[[socket.socket], None]:
    """Answers each request of a connection with the next of ``answers``."""
    def serve(conn: socket.socket) -> None:
        for answer in answers:
            if not _read_request(conn):
                return
            conn.sendall(answer)
            if close:
                return
    return serve


@pytest.fixture
def fake() -> Iterator[Callable[[Callable[[socket.socket], None]], _Fake]]:
    made: list[_Fake] = []

    def make(serve: Callable[[socket.socket], None]) -> _Fake:
        made.append(_Fake(serve))
        return made[-1]
    yield make
    for f in made:
        f.close()


def _fake_writer(endpoint: str, timeout_s: float = 5.0) -> S3Writer:
    return S3Writer(endpoint, False, "key", "secret", "bucket", timeout_s=timeout_s)


def test_nothing_listening_is_an_outage() -> None:
    spare = socket.create_server((LOOPBACK, 0))
    endpoint = f"{LOOPBACK}:{spare.getsockname()[1]}"
    spare.close()
    with pytest.raises(S3Unreachable) as down:
        _fake_writer(endpoint).put("x", b"x", {})
    assert is_transient(down.value)


def test_a_server_that_never_answers_times_out(fake: Callable[..., _Fake]) -> None:
    silent = fake(lambda conn: (_read_request(conn), conn.recv(1)))
    with pytest.raises(S3Unreachable, match="timed out") as down:
        _fake_writer(silent.endpoint, timeout_s=0.5).put("x", b"x", {})
    assert is_transient(down.value)


def test_a_proxys_page_and_throttling_are_transient_and_a_chunked_answer_is_read(
        fake: Callable[..., _Fake]) -> None:
    page = (b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: 11\r\n"
            b"\r\nbad gateway")
    xml = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
           b"<Message>Please reduce your request rate.</Message></Error>")
    chunked = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"
               + f"{len(xml[:40]):x}\r\n".encode() + xml[:40] + b"\r\n"
               + f"{len(xml[40:]):x}\r\n".encode() + xml[40:] + b"\r\n0\r\n\r\n")
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = fake(_answering(page, chunked, ok))
    w = _fake_writer(server.endpoint)
    with pytest.raises(InvalidResponseError) as proxy:
        w.put("x", b"x", {})
    assert is_transient(proxy.value)
    with pytest.raises(S3Error) as slow:
        w.put("x", b"x", {})
    assert slow.value.code == "SlowDown" and is_transient(slow.value)
    w.put("x", b"x", {})  # the same connection still: every answer was read whole
    assert server.accepted == 1


def test_a_broken_answer_is_an_outage_and_its_connection_is_not_kept(
        fake: Callable[..., _Fake]) -> None:
    cut = fake(_answering(b"HTTP/1.1 200 OK\r\nContent-Len", close=True))
    with pytest.raises(S3Unreachable):
        _fake_writer(cut.endpoint).put("x", b"x", {})
    junk = fake(_answering(b"SSH-2.0-OpenSSH_9.6\r\n", close=True))
    with pytest.raises(S3Unreachable, match="not an HTTP answer"):
        _fake_writer(junk.endpoint).put("x", b"x", {})
    huge = fake(_answering(b"HTTP/1.1 500 x\r\nContent-Length: 99999999999\r\n\r\n",
                           close=True))
    with pytest.raises(S3Unreachable, match="bytes"):
        _fake_writer(huge.endpoint).put("x", b"x", {})


def test_a_kept_connection_closed_after_its_answer_is_replaced_unseen(
        fake: Callable[..., _Fake]) -> None:
    """A server (or proxy) that closes each connection after one answer, without
    saying so: the second write goes on a new connection, without a failure."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = fake(_answering(ok, close=True))
    w = _fake_writer(server.endpoint)
    for _ in range(3):
        w.put("x", b"x", {})
    assert server.accepted == 3


def test_tls_is_verified_against_the_configured_cas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose certificate this machine trusts (``SSL_CERT_FILE``) is written to;
    one it does not is refused at once as TLS, never waited out as an outage."""
    import ssl

    cert, private = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, private)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    answer = _answering(ok, ok)

    def serve(conn: socket.socket) -> None:
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                answer(tls)
        except (ssl.SSLError, OSError):
            pass  # a client that refused the certificate hung up
    server = _Fake(serve)
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        trusting = S3Writer(server.endpoint, True, "key", "secret", "bucket", timeout_s=5)
        trusting.put("x", b"x", {})
        trusting.put("y", b"y", {})  # the same TLS connection, kept
        assert server.accepted == 1
        trusting.close()
        monkeypatch.delenv("SSL_CERT_FILE")
        wary = S3Writer(server.endpoint, True, "key", "secret", "bucket", timeout_s=5)
        with pytest.raises(S3Unreachable) as refused:
            wary.put("x", b"x", {})
        assert refusal(refused.value) == "tls" and not is_transient(refused.value)
        assert "TLS failed" in describe(refused.value)
    finally:
        server.close()


# -- the store through it ---------------------------------------------------------------------
def test_the_store_keeps_its_rules_through_the_writer(minio_server: MinioServer) -> None:
    store = make_store(minio_server, new_bucket())
    assert store._writer is not None  # no pool of the test's: writes go around the SDK
    low = lowered("__kernel void through_the_writer() {}")
    mine = key(1)
    assert store.claim_source(NS, low.source_hash, mine) == (None, True)
    assert store.put(NS, art(mine, b"bin", low.source_hash), source=low) is PutResult.STORED
    assert store.put(NS, art(mine, b"bin", low.source_hash), source=low) is PutResult.SAME
    assert store.put(NS, art(mine, b"other", low.source_hash)) is PutResult.REFUSED
    assert store.claim_source(NS, low.source_hash, key(2)) == (mine, False)
    sdk = raw(minio_server)
    sdk.put_object(store.bucket, artifact_object(NS, mine),  # damaged behind its back
                   io.BytesIO(b"garbage"), 7)
    assert store.get(NS, mine) is None
    assert store.put(NS, art(mine, b"bin", low.source_hash)) is PutResult.STORED  # repaired
    got = store.get(NS, mine)
    assert got is not None and got.binary == b"bin"
    assert sdk.get_object(store.bucket, source_object(NS, low.source_hash)).read() == \
        str(mine).encode()
    store.close()


def test_a_given_region_is_never_asked_for_and_none_is_asked_once(
        minio_server: MinioServer) -> None:
    bucket = new_bucket()
    given = CountingPool()
    store = make_store(minio_server, bucket, http_client=given)  # us-east-1, the default
    given.reset()  # the bucket's check
    store.put(NS, art(key(1), b"x"))
    assert store.get(NS, key(1)) is not None
    assert not [url for _, url in given.requests if "location" in url]
    asked = CountingPool()
    other = make_store(minio_server, bucket, http_client=asked,
                       client=ClientOptions(region="", check_bucket=False))
    assert other.get(NS, key(1)) is not None and other.get(NS, key(2)) is None
    assert len([url for _, url in asked.requests if "location" in url]) == 1
    store.close()
    other.close()


def test_a_server_of_another_region_says_which_setting_is_wrong(tmp_path: Path) -> None:
    with MinioServer(tmp_path, {"MINIO_SITE_REGION": "eu-west-1"}) as server:
        settings = Settings(minio_endpoint=server.endpoint, minio_access_key=server.access_key,
                            minio_secret_key=server.secret_key, minio_bucket=new_bucket(),
                            outage_limit=1.0)
        with pytest.raises(StoreError, match="FARM_MINIO_REGION") as wrong:
            open_store(settings, shared=True)
        assert "eu-west-1" in str(wrong.value) and server.secret_key not in str(wrong.value)
        store = open_store(settings.model_copy(update={"minio_region": "eu-west-1"}),
                           shared=True)
        assert isinstance(store, MinioStore)
        assert store._writer is not None
        assert store.put(NS, art(key(1), b"x")) is PutResult.STORED
        assert store.get(NS, key(1)) is not None
        store.close()
