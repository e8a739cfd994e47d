"""Which failures of an S3 request are worth repeating, how often, and how one is told.

Kept beside the MinIO store rather than in it so that the rule is one place: tenacity
retries what :func:`is_transient` accepts, everything else becomes one
:class:`~farm.core.errors.StoreError` line that names what failed, an ``AccessDenied``
a :class:`~farm.core.errors.StoreAccessDenied` (read-only credentials, a pool writing
another's namespace), never with request signatures or credentials.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from xml.etree import ElementTree

import certifi
import urllib3
from minio.error import InvalidResponseError, S3Error, ServerError

from farm.core.errors import StoreAccessDenied, StoreError
from farm.core.outage import TLS_HINT, refusal, tls_detail

#: S3 error codes that mean "try again", whatever the HTTP status
_TRANSIENT_CODES = frozenset({
    "SlowDown", "SlowDownRead", "SlowDownWrite", "InternalError", "ServiceUnavailable",
    "RequestTimeout", "OperationTimedOut", "XMinioServerNotInitialized",
    "XMinioReadQuorum", "XMinioWriteQuorum",
})


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request is worth repeating: the network, 5xx, or throttling.

    A 4xx (access denied, a missing bucket, a failed precondition) will fail the same way
    again, so it is not retried.
    """
    if refusal(exc):  # a wrong key or an untrusted certificate: waiting fixes neither
        return False
    if isinstance(exc, S3Error):
        status = getattr(exc.response, "status", 0) or 0
        return exc.code in _TRANSIENT_CODES or status >= 500
    if isinstance(exc, ServerError):
        return exc.status_code >= 500
    if isinstance(exc, InvalidResponseError):  # a non-XML answer, e.g. a proxy's 502 page
        return int(getattr(exc, "_code", 0) or 0) >= 500
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


#: S3 error codes that mean the credentials, not the request, are wrong
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "InvalidToken", "ExpiredToken"})


def describe(exc: BaseException) -> str:
    """One line about a failure, without request signatures or credentials: what
    failed (the credentials, TLS, the request) and which setting to look at."""
    if isinstance(exc, S3Error):
        if exc.code in _CREDENTIAL_CODES:
            return (f"the credentials were refused ({exc.code}: {exc.message}): check "
                    "FARM_MINIO_ACCESS_KEY and FARM_MINIO_SECRET_KEY")
        if "region" in (exc.message or "").lower():  # signed for another region
            return (f"the region signed for was refused ({exc.code}: {exc.message}): set "
                    "FARM_MINIO_REGION to the server's region")
        return f"{exc.code}: {exc.message}"
    if refusal(exc) == "tls":
        return f"TLS failed ({tls_detail(exc)}): {TLS_HINT}"
    return f"{type(exc).__name__}: {exc}"


FAILURES = (S3Error, ServerError, InvalidResponseError, urllib3.exceptions.HTTPError, OSError)


def store_error(where: str, exc: BaseException) -> StoreError:
    """One line for a failed request: ``<where>: <what failed>``."""
    message = f"{where}: {describe(exc)}"
    if isinstance(exc, S3Error) and exc.code == "AccessDenied":
        return StoreAccessDenied(message)
    return StoreError(message)


def make_http_client(timeout_s: float) -> urllib3.PoolManager:
    """A pool without urllib3's retries (tenacity retries instead, see the module doc),
    sized for the thread pools that read and write the store at once."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=min(timeout_s, 10.0), read=timeout_s),
        maxsize=32,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=False,
    )


@dataclass(frozen=True)
class Retry:
    """How a :class:`MinioStore` retries a transient failure: ``attempts`` tries per
    request in all, waiting ``wait_s`` doubled each time (at most ``max_wait_s``) in
    between; ``outage_limit_s`` replaces the attempts by waiting out an outage that long
    (:mod:`farm.core.outage`); ``timeout_s`` bounds one request's connect and read."""

    attempts: int = 5
    wait_s: float = 0.1
    max_wait_s: float = 2.0
    timeout_s: float = 60.0
    outage_limit_s: float | None = None


def answer_error(status: int, headers: Mapping[str, str], body: bytes) -> Exception:
    """What the SDK raises for an answer of ``status`` (not 2xx) to a request on an
    object: an ``S3Error`` with the code of S3's XML (``PreconditionFailed``,
    ``SlowDown``...), an ``InvalidResponseError`` for an answer that is not S3's (a
    proxy's page). For requests sent without the SDK (:mod:`farm.store.s3_put`), so
    that :func:`is_transient`, :func:`describe` and the store's rules read both alike."""
    response = urllib3.HTTPResponse(body=body, status=status, headers=dict(headers),
                                    preload_content=True)
    if body and "application/xml" in headers.get("content-type", "").split(";"):
        try:
            return S3Error.fromxml(response)
        except (ElementTree.ParseError, UnicodeDecodeError):  # not S3's answer after all
            pass
    return InvalidResponseError(status, headers.get("content-type"),
                                body.decode("utf-8", "replace")[:500] or None)


@dataclass(frozen=True)
class ClientOptions:
    """How a :class:`~farm.store.minio.MinioStore` is opened: the region its requests
    are signed for (``FARM_MINIO_REGION``; "" asks the server, a request once a
    process), and whether the bucket is checked, and made if missing, now (not in a
    worker's pool process: its main process checked it, and a process start must not
    wait on MinIO); and the repair role's credentials (access, secret), with which a
    delete removes every version of an object (:mod:`farm.store.minio_removal`)."""

    region: str = "us-east-1"
    check_bucket: bool = True
    repair: tuple[str, str] | None = field(default=None, repr=False)
