"""Writing one object to MinIO (S3) with the standard library: a signed, conditional PUT.

Why not the ``minio`` SDK for these: a worker writes two objects a compiled kernel (its
source-index entry, its artifact), and through the SDK each cost the worker 0.5 ms of
Python (urllib3's pool and header dictionaries, ``http.client``'s e-mail parser for the
answer's headers, the SDK's own header building): half of what a pool process spent
on a kernel beyond Celery (docs/BENCHMARKS.md, "Where a kernel's control-plane cost
goes"). Here one PUT is one request written to a kept-alive socket and one answer read
from it, 0.15 ms; every other request (reads, listings, deletes) stays with the SDK.

The request is what the SDK sends: path-style (``/<bucket>/<name>``), signed with
Signature Version 4 for the ``s3`` service in ``FARM_MINIO_REGION`` (MinIO's own
``us-east-1`` unless configured otherwise), its payload's SHA-256 signed too (so a body
altered on the way is refused), the caller's headers as given: the user metadata and
``If-None-Match: *`` / ``If-Match: <etag>``, the conditional writes of first-writer-wins.

Answers: 200 is written; any other answer raises what the SDK would have raised for
it (:func:`farm.store.s3_failures.answer_error`: an ``S3Error`` with MinIO's code, so a
412 is ``PreconditionFailed``), so the store's rules and retries read both alike; no
answer at all (refused, reset, a timeout after ``timeout_s``) raises
:class:`S3Unreachable`, a ``ConnectionError``, which the store waits out as an outage.
A connection is kept per thread; one the server closed while idle is noticed before it
is used, and a request whose kept connection failed before any answer is sent once more
on a new one (a conditional write sent twice is refused the second time, which the
store reads as what it is: the object is there).
"""

from __future__ import annotations

import hashlib
import os
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from urllib.parse import quote

import certifi

from farm.store.s3_failures import ClientOptions, answer_error
from farm.store.s3_request import S3Unreachable, sign, signing_key

#: the longest answer read back (an error's XML is a few hundred bytes)
_MAX_ANSWER_BYTES = 1 << 20
#: the most header lines an answer may have
_MAX_HEADERS = 100


#: what a header's name and value may hold (one line of printable ASCII: no way to end
#: the header early and start another)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[ -~]*")


class _Connection:
    """One kept-alive connection: its socket and a buffered reader of it."""

    def __init__(self, endpoint: str, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]") or endpoint
        sock = socket.create_connection((host, int(port) if port.isdigit() else
                                         (443 if tls else 80)), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.reader = sock.makefile("rb")
        self.used = False

    def dropped(self) -> bool:
        """Whether the server closed it while it was idle (it is readable, or broken)."""
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()


class S3Writer:
    """Signed PUTs into one bucket (see the module docstring); safe to share between
    threads (a connection each)."""

    def __init__(self, endpoint: str, secure: bool, access_key: str, secret_key: str,
                 bucket: str, *, region: str = ClientOptions.region, timeout_s: float = 60.0
                 ) -> None:
        """``endpoint`` is ``host:port``; ``timeout_s`` bounds each connect, each send
        and each read of an answer."""
        self.endpoint = endpoint
        self.secure = secure
        self.bucket = bucket
        self.region = region
        self.timeout_s = timeout_s
        self._access = access_key
        self._secret = secret_key
        self._key: tuple[str, bytes] = ("", b"")
        #: what TLS verifies with (``SSL_CERT_FILE``, else certifi's CAs, as the SDK's
        #: pool does), read when the writer is made
        self._tls = ssl.create_default_context(
            cafile=os.environ.get("SSL_CERT_FILE") or certifi.where()) if secure else None
        self._local = threading.local()
        self._all: set[_Connection] = set()
        self._lock = threading.Lock()

    def put(self, name: str, body: bytes, headers: Mapping[str, str]) -> None:
        """Write ``body`` as object ``name`` with ``headers`` (any case; ``Content-Type``,
        user metadata, ``If-None-Match`` / ``If-Match``). Returns when written; raises
        the SDK's error of any other answer, :class:`S3Unreachable` when none came."""
        path = "/" + quote(f"{self.bucket}/{name}", safe="/-_.~")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        given = {k.lower(): str(v) for k, v in headers.items()}
        if not all(_HEADER_NAME.fullmatch(k) and _HEADER_VALUE.fullmatch(v)
                   for k, v in given.items()):
            raise ValueError(f"a header of {name} is not one line of printable ASCII")
        signed = sign("PUT", path, {**given, "host": self.endpoint,
                                    "content-length": str(len(body))},
                      hashlib.sha256(body).hexdigest(), access_key=self._access,
                      key=self._day_key(stamp[:8]), stamp=stamp, region=self.region)
        request = "".join([f"PUT {path} HTTP/1.1\r\n",
                           *(f"{k}: {v}\r\n" for k, v in signed.items()), "\r\n"])
        status, answer, body_back = self._exchange(request.encode("latin-1") + body)
        if status != 200:
            raise answer_error(status, answer, body_back)

    def _day_key(self, day: str) -> bytes:
        held = self._key
        if held[0] != day:
            held = (day, signing_key(self._secret, day, self.region))
            self._key = held
        return held[1]

    def _exchange(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """Send ``request``, read its answer; once more on a new connection when a kept
        one failed before answering."""
        conn = self._connection()
        reused = conn.used
        try:
            conn.sock.sendall(request)
            first = conn.reader.readline(65537)
            if not first and reused:
                raise ConnectionResetError("closed before answering")
        except OSError as exc:
            self._discard(conn)
            if not reused or isinstance(exc, TimeoutError):
                raise S3Unreachable(f"{type(exc).__name__}: {exc}") from exc
            conn = self._connection()
            try:
                conn.sock.sendall(request)
                first = conn.reader.readline(65537)
            except OSError as again:
                self._discard(conn)
                raise S3Unreachable(f"{type(again).__name__}: {again}") from again
        try:
            return self._answer(conn, first)
        except (OSError, ValueError) as exc:
            self._discard(conn)
            raise S3Unreachable(f"{type(exc).__name__}: {exc}") from exc

    def _answer(self, conn: _Connection, first: bytes) -> tuple[int, dict[str, str], bytes]:
        """The status, headers (lower-case names) and body of the answer whose status
        line is ``first``; the connection kept for the next request unless it ends."""
        parts = first.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP answer: {first[:80]!r}")
        status, headers = int(parts[1]), {}
        for _ in range(_MAX_HEADERS + 1):
            line = conn.reader.readline(65537)
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ValueError("the answer ended in its headers")
            # a write's answer: only its framing is read (Content-Length, Connection,
            # Transfer-Encoding); an error's: every header, for the SDK's error
            if status != 200 or line[:1] in b"CcTt":
                field, _, value = line.decode("latin-1").partition(":")
                headers[field.strip().lower()] = value.strip()
        else:
            raise ValueError(f"an answer of more than {_MAX_HEADERS} headers")
        body = self._body(conn, headers)
        if parts[0] == b"HTTP/1.0" or headers.get("connection", "").lower() == "close":
            self._discard(conn)
        else:
            conn.used = True
        return status, headers, body

    @staticmethod
    def _body(conn: _Connection, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = bytearray()
            while True:
                size = int(conn.reader.readline(1024).split(b";")[0].strip() or b"x", 16)
                if size == 0:
                    while conn.reader.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                if len(out) + size > _MAX_ANSWER_BYTES:
                    raise ValueError(f"an answer over {_MAX_ANSWER_BYTES} bytes")
                out += conn.reader.read(size)
                conn.reader.readline(8)
        length = headers.get("content-length")
        if length is None:  # to the end of the connection
            body = conn.reader.read(_MAX_ANSWER_BYTES + 1)
            headers["connection"] = "close"
        else:
            if not length.isdigit() or int(length) > _MAX_ANSWER_BYTES:
                raise ValueError(f"an answer of {length} bytes")
            body = conn.reader.read(int(length))
            if len(body) < int(length):
                raise ValueError("the answer ended in its body")
        if len(body) > _MAX_ANSWER_BYTES:
            raise ValueError(f"an answer over {_MAX_ANSWER_BYTES} bytes")
        return body

    def _connection(self) -> _Connection:
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.used and conn.dropped():
            self._discard(conn)
            conn = None
        if conn is None:
            try:
                conn = _Connection(self.endpoint, self._tls, self.timeout_s)
            except OSError as exc:
                raise S3Unreachable(f"{type(exc).__name__}: {exc}") from exc
            self._local.conn = conn
            with self._lock:
                self._all.add(conn)
        return conn

    def _discard(self, conn: _Connection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._all.discard(conn)
        try:
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        """Close every thread's connection (a later PUT opens another)."""
        with self._lock:
            conns, self._all = list(self._all), set()
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
