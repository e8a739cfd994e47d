"""A store's URL, and what opening one asks beyond it.

The scheme names the backend (:data:`farm.store.open.BACKENDS`), the rest is the
backend's: ``sqlite:///<absolute path>``, ``memory://``, ``minio://host:port/bucket``
(``s3://`` alike; ``?secure=true`` for TLS), ``tiered:<url>|<url>...`` (front tier first,
the shared truth last). A URL never carries credentials: MinIO's come from
``FARM_MINIO_ACCESS_KEY`` and ``FARM_MINIO_SECRET_KEY``, and a URL with a user part is
refused without being echoed (it would be in logs and error lines).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qs, urlsplit

from farm.core.errors import SettingsError
from farm.core.outage import Waiter
from farm.core.settings import Settings

#: what separates the tiers of a ``tiered:`` URL (a path holding one is percent-encoded)
TIER_SEPARATOR = "|"
#: a user part (``user:password@``) after a scheme, in any tier
_USER_PART = re.compile(r"://[^/|?#]*@")


@dataclass(frozen=True)
class Opening:
    """What a process asks of a store it opens, beyond its URL.

    ``settings``: credentials, timeouts, the outage limit. ``create``: make what is
    missing now (MinIO's bucket); ``False`` sends nothing at opening (a worker's pool
    process: its main process checked, and a process start must not wait on MinIO).
    ``probe``: one attempt per request, no outage waited out (a readiness check must
    answer now). ``reads``: a process that mostly reads (a served application): MinIO is
    opened as :class:`~farm.store.minio_reads.MinioReads`, its GETs waited out by this
    waiter."""

    settings: Settings
    create: bool = True
    probe: bool = False
    reads: Waiter | None = None


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL (``text`` as given, for messages: it holds no credentials)."""

    text: str
    parts: SplitResult

    @classmethod
    def parse(cls, text: str) -> StoreURL:
        parts = urlsplit(text.strip())
        if _USER_PART.search(text):  # in any tier of a tiered URL too
            raise SettingsError("store URL: must not carry credentials (user:password@); "
                                "set FARM_MINIO_ACCESS_KEY and FARM_MINIO_SECRET_KEY")
        if not parts.scheme:
            raise SettingsError(f"store URL {text!r}: no scheme (sqlite:///<file>, "
                                "memory://, minio://host:port/bucket, tiered:<url>|<url>)")
        return cls(text.strip(), parts)

    @property
    def scheme(self) -> str:
        return self.parts.scheme.lower()

    def query(self, name: str) -> str | None:
        """The last value of query parameter ``name`` (``None``: not given)."""
        values = parse_qs(self.parts.query, keep_blank_values=True).get(name)
        return values[-1] if values else None

    def flag(self, name: str) -> bool:
        value = (self.query(name) or "false").lower()
        if value not in ("true", "false", "1", "0"):
            raise self.error(f"{name} must be true or false, not {value!r}")
        return value in ("true", "1")

    def bucket(self) -> tuple[str, str, bool]:
        """``host:port``, bucket and TLS of ``minio://host:port/bucket`` (``s3://`` alike;
        ``?secure=true``); a :class:`SettingsError` for any other shape."""
        bucket = self.parts.path.strip("/")
        if not self.parts.netloc or not bucket or "/" in bucket:
            raise self.error("not minio://host:port/bucket")
        return self.parts.netloc, bucket, self.flag("secure")

    def error(self, why: str) -> SettingsError:
        return SettingsError(f"store URL {self.text!r}: {why}")
