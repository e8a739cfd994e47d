"""What the standard library's S3 requests share (:mod:`farm.store.s3_get`'s GET, a
served application's reads; :mod:`farm.store.s3_put`'s PUT, a worker's writes):
Signature Version 4 for the ``s3`` service, the endpoint ``FARM_MINIO_ENDPOINT`` names,
and the error of a service that did not answer. The standard library only: a served
application imports it before its first miss.
"""

from __future__ import annotations

import hashlib
import hmac

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (farm run)
if TYPE_CHECKING:
    from collections.abc import Mapping

#: the region MinIO signs for unless configured otherwise (``FARM_MINIO_REGION``)
REGION = "us-east-1"
#: the SHA-256 of an empty payload (a GET's)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class S3Unreachable(ConnectionError):
    """The service did not answer (refused, reset, timed out, a broken answer)."""


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()


def signing_key(secret_key: str, day: str, region: str) -> bytes:
    """Signature Version 4's key of one day (``YYYYMMDD``) and region for ``s3``."""
    return _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), region), "s3"),
                 "aws4_request")


def sign(method: str, path: str, headers: Mapping[str, str], payload_sha256: str, *,
         access_key: str, key: bytes, stamp: str, region: str) -> dict[str, str]:
    """``headers`` (``host`` among them; names in lower case) with the date, the
    payload's hash and the ``authorization`` of a Signature Version 4 request of
    ``method`` on ``path`` (URI-encoded, no query) at ``stamp`` (``YYYYMMDDTHHMMSSZ``),
    ``key`` being :func:`signing_key` of that day. Every header is signed; a value's runs
    of spaces count as one, as S3 canonicalises them."""
    signed = {**headers, "x-amz-content-sha256": payload_sha256, "x-amz-date": stamp}
    names = sorted(signed)
    canonical = "\n".join([
        method, path, "", *(f"{n}:{' '.join(signed[n].split())}" for n in names), "",
        ";".join(names), payload_sha256])
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                         hashlib.sha256(canonical.encode("utf-8")).hexdigest()])
    signature = hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    signed["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                               f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return signed


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
