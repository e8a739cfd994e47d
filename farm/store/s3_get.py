"""Reading one object from MinIO (S3) with the standard library: a signed GET.

Why not the ``minio`` SDK here: importing it costs a process 0.1 to 0.3 s (urllib3, and
pycryptodome through cffi, which parses C declarations at import), which a served
application paid at its first build on every fresh node, for requests that are all
plain GETs of stored artifacts. So the reads a served application makes before its first
miss (:mod:`farm.programs.quick`) are signed here (AWS Signature Version 4, the
``s3`` service, path-style addressing, ``FARM_MINIO_REGION``'s region: ``us-east-1``,
MinIO's default, unless set) and sent with :mod:`http.client`; everything else
(writes, listings, a store whose region or answers this reader does not expect) goes through
:class:`farm.store.minio.MinioStore`, which the caller opens on its first miss.

Answers: the object's bytes; ``None`` for no such object (or bucket: nothing stored);
:class:`S3Declined` for an answer this reader does not handle (a 4xx: refused
credentials, another region), which the caller leaves to the SDK; and for what an
outage looks like (no connection, a timeout, a 5xx) :class:`S3Unreachable`, an
``OSError``, which the caller waits out (:mod:`farm.core.outage`).
"""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import quote

from farm.store.s3_request import (
    EMPTY_SHA256,
    REGION,
    S3Unreachable,
    sign,
    signing_key,
)

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import http.client

#: the largest object read (an artifact frame is bounded well below it)
MAX_OBJECT_BYTES = 1024 * 1024 * 1024


class S3Declined(Exception):
    """An answer this reader leaves to the SDK (see the module docstring)."""


class S3Reader:
    """GETs of one bucket; one kept-alive connection per thread."""

    def __init__(self, endpoint: str, secure: bool, access_key: str, secret_key: str,
                 bucket: str, timeout_s: float, region: str = REGION) -> None:
        """``endpoint`` is ``host:port`` (as ``FARM_MINIO_ENDPOINT`` without a scheme);
        ``timeout_s`` bounds each connect and each read; ``region`` is
        ``FARM_MINIO_REGION``."""
        self.endpoint = endpoint
        self.secure = secure
        self.bucket = bucket
        self._access, self._secret = access_key, secret_key
        self.timeout_s = timeout_s
        self.region = region or REGION
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            import http.client

            if self.secure:
                import ssl

                cafile = os.environ.get("SSL_CERT_FILE")
                if not cafile:
                    import certifi

                    cafile = certifi.where()
                context = ssl.create_default_context(cafile=cafile)
                conn = http.client.HTTPSConnection(self.endpoint, timeout=self.timeout_s,
                                                   context=context)
            else:
                conn = http.client.HTTPConnection(self.endpoint, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def get(self, name: str) -> bytes | None:
        """The object ``name`` of the bucket (see the module docstring for the answers)."""
        path = "/" + quote(f"{self.bucket}/{name}", safe="/-_.~")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        headers = sign("GET", path, {"host": self.endpoint}, EMPTY_SHA256,
                       access_key=self._access, stamp=stamp, region=self.region,
                       key=signing_key(self._secret, stamp[:8], self.region))
        conn = self._connection()
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            length = int(response.getheader("content-length") or 0)
            if length <= MAX_OBJECT_BYTES:
                body = response.read()
        except Exception as exc:  # OSError, or http.client's own (a broken answer)
            self.close()
            raise S3Unreachable(f"{type(exc).__name__}: {exc}") from exc
        if length > MAX_OBJECT_BYTES:
            self.close()
            raise S3Declined(f"{name}: {length} bytes, over {MAX_OBJECT_BYTES}")
        if response.status == 200:
            return body
        if response.status == 404:
            return None
        if response.status >= 500:
            raise S3Unreachable(f"MinIO answered {response.status} {response.reason}")
        raise S3Declined(f"{name}: MinIO answered {response.status} {response.reason}")

    def close(self) -> None:
        """Close this thread's connection (the next GET opens another)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
