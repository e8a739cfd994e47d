"""Reading one object from MinIO (S3) with the standard library: a signed GET.

Why not the ``minio`` SDK here: importing it costs a process 0.1 to 0.3 s (urllib3, and
pycryptodome through cffi, which parses C declarations at import), which a served
application paid at its first build on every fresh node, for requests that are all
plain GETs of stored artifacts. So the reads a served application makes before its first
miss (:mod:`farm.programs.quick`) are signed here (AWS Signature Version 4, the
``s3`` service, path-style addressing, region ``us-east-1`` as MinIO answers by default)
and sent with :mod:`http.client`; everything else (writes, listings, a store whose
region or answers this reader does not expect) goes through
:class:`farm.store.minio.MinioStore`, which the caller opens on its first miss.

Answers: the object's bytes; ``None`` for no such object (or bucket: nothing stored);
:class:`S3Declined` for an answer this reader does not handle (a 4xx: refused
credentials, another region), which the caller leaves to the SDK; and for what an
outage looks like (no connection, a timeout, a 5xx) :class:`S3Unreachable`, an
``OSError``, which the caller waits out (:mod:`farm.core.outage`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import threading
from urllib.parse import quote

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import http.client

#: the region MinIO signs for unless configured otherwise
REGION = "us-east-1"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: the largest object read (an artifact frame is bounded well below it)
MAX_OBJECT_BYTES = 1024 * 1024 * 1024


class S3Declined(Exception):
    """An answer this reader leaves to the SDK (see the module docstring)."""


class S3Unreachable(OSError):
    """The service did not answer, or answered that it cannot now (5xx)."""


def parse_endpoint(raw: str, secure: bool) -> tuple[str, bool]:
    """``host:port`` and whether TLS is on, from ``FARM_MINIO_ENDPOINT`` (``host:port``,
    TLS as ``secure`` says, or a URL whose scheme says it: ``https://host:port``);
    ``ValueError`` for anything else."""
    if "://" not in raw:
        return raw, secure
    from urllib.parse import urlsplit

    url = urlsplit(raw)
    if url.scheme not in ("http", "https") or not url.netloc or url.path not in ("", "/") \
            or url.query:
        raise ValueError(f"not host:port or http(s)://host:port: {raw!r}")
    return url.netloc, url.scheme == "https"


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()


def sign_get(host: str, path: str, access_key: str, secret_key: str,
             now: dt.datetime, region: str = REGION) -> dict[str, str]:
    """The headers of a GET of ``path`` (already URI-encoded) on ``host`` signed with
    Signature Version 4 at time ``now`` (UTC)."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
    names = ";".join(sorted(headers))
    canonical = "\n".join(["GET", path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)),
                           "", names, _EMPTY_SHA256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                         hashlib.sha256(canonical.encode("utf-8")).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), region), "s3"),
                "aws4_request")
    signature = hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                                f"SignedHeaders={names}, Signature={signature}")
    return headers


class S3Reader:
    """GETs of one bucket; one kept-alive connection per thread."""

    def __init__(self, endpoint: str, secure: bool, access_key: str, secret_key: str,
                 bucket: str, timeout_s: float) -> None:
        """``endpoint`` is ``host:port`` (as ``FARM_MINIO_ENDPOINT`` without a scheme);
        ``timeout_s`` bounds each connect and each read."""
        self.endpoint = endpoint
        self.secure = secure
        self.bucket = bucket
        self._access, self._secret = access_key, secret_key
        self.timeout_s = timeout_s
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
        headers = sign_get(self.endpoint, path, self._access, self._secret,
                           dt.datetime.now(dt.UTC))
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
