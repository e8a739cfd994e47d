"""Which store a process uses: a URL whose scheme names its backend, and the one opener.

Celery's result backends are the model (``celery/app/backends.py``): :data:`BACKENDS`
maps a scheme to its backend class, imported only when a URL names it, so a process
whose store is SQLite never imports the minio SDK (an optional extra). Every process
opens its store through :func:`open_store`: the loader, the CLI, the cluster's client,
the embedded farm, the program hook, a worker's pool processes, its readiness probe and
the access set-up job. ``tests/test_store_contract.py`` fails on a store built anywhere
else in ``farm/``, ``worker/`` or ``loader/``, and runs every backend through the same
cases. CONTRIBUTING.md ("Adding a store backend") walks through a new one.

The URL comes from the settings (:func:`store_url`): ``FARM_STORE_URL`` when set; else
the environment's SQLite file, and with ``FARM_MINIO_ENDPOINT`` that file as the local
tier in front of MinIO (the shared truth), so a machine keeps what it loaded or compiled
and a second run needs no network. A worker opens only the shared truth
(:func:`shared_url`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING
from urllib.parse import quote

from farm.core.errors import SettingsError
from farm.store.s3_request import parse_endpoint
from farm.store.url import TIER_SEPARATOR, Opening, StoreURL

if TYPE_CHECKING:
    from pathlib import Path

    from farm.core.outage import Waiter
    from farm.core.settings import Settings
    from farm.store.base import ArtifactStore

#: scheme -> ``module:class`` of its backend (a subclass of
#: :class:`~farm.store.base.ArtifactStore` with a ``from_url`` classmethod)
BACKENDS: dict[str, str] = {
    "sqlite": "farm.store.sqlite:SQLiteStore",
    "memory": "farm.store.memory:MemoryStore",
    "minio": "farm.store.minio:MinioStore",
    "s3": "farm.store.minio:MinioStore",
    "tiered": "farm.store.tiered:TieredStore",
}
#: scheme -> the backend of a process that mostly reads (an :class:`Opening` with
#: ``reads``): MinIO's artifacts read with signed GETs, its SDK imported at first other use
READERS: dict[str, str] = {
    "minio": "farm.store.minio_reads:MinioReads",
    "s3": "farm.store.minio_reads:MinioReads",
}


def backend_of(url: StoreURL, *, reads: bool = False) -> type[ArtifactStore]:
    """The backend class ``url``'s scheme names (imported now); ``reads``: the one of a
    process that mostly reads, where the scheme has one."""
    target = (reads and READERS.get(url.scheme)) or BACKENDS.get(url.scheme)
    if target is None:
        raise url.error(f"no store backend for scheme {url.scheme!r} (known: "
                        f"{', '.join(sorted(BACKENDS))})")
    module, _, name = target.partition(":")
    try:
        found: type[ArtifactStore] = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise url.error(f"the {url.scheme} backend needs the {exc.name} package "
                        "(pip install 'kernel-farm[cluster]')") from None
    return found


def open_url(url: str | StoreURL, opening: Opening) -> ArtifactStore:
    """The store ``url`` names, opened by its backend."""
    parsed = url if isinstance(url, StoreURL) else StoreURL.parse(url)
    return backend_of(parsed, reads=opening.reads is not None).from_url(parsed, opening)


def open_store(settings: Settings, *, shared: bool = False, create: bool = True,
               probe: bool = False, signed: bool = True,
               remote_reads: Waiter | None = None) -> ArtifactStore:
    """The store a process uses (:func:`store_url`; ``shared``: only the store the
    cluster's processes share, :func:`shared_url`, a worker's), wrapped by the signing
    rules the settings ask for (``signed``: a readiness probe or the access set-up reads
    no artifact, and needs none); ``create`` and ``probe`` as
    :class:`~farm.store.url.Opening` says; ``remote_reads``: MinIO is read with signed
    GETs waited out by this waiter, and its SDK imported only for what else is asked
    (:mod:`farm.store.minio_reads`: a served application, which mostly reads)."""
    from farm.store.signing import with_signatures

    store = open_url(shared_url(settings) if shared else store_url(settings),
                     Opening(settings, create=create, probe=probe, reads=remote_reads))
    return with_signatures(store, settings) if signed else store


def store_url(settings: Settings) -> str:
    """``FARM_STORE_URL``, else the environment's SQLite file, in front of MinIO when
    ``FARM_MINIO_ENDPOINT`` is set."""
    if settings.store_url:
        return settings.store_url
    local = sqlite_url(settings.store_path)
    if not settings.minio_endpoint:
        return local
    return f"tiered:{local}{TIER_SEPARATOR}{minio_url(settings)}"


def shared_url(settings: Settings) -> str:
    """The store every process of a cluster shares (a worker's only one): the last tier
    of ``FARM_STORE_URL``, else MinIO's."""
    if settings.store_url:
        return tier_urls(StoreURL.parse(settings.store_url))[-1]
    return minio_url(settings)


def tier_urls(url: StoreURL) -> list[str]:
    """The tiers of a ``tiered:`` URL, front first; any other URL is its one tier."""
    if url.scheme != "tiered":
        return [url.text]
    tiers = [t.strip() for t in url.text.partition(":")[2].split(TIER_SEPARATOR)]
    if not all(tiers):
        raise url.error(f"a tier is empty (tiers are separated by {TIER_SEPARATOR!r})")
    return tiers


def sqlite_url(path: Path) -> str:
    """The URL of a SQLite store at ``path`` (absolute; odd characters percent-encoded)."""
    return f"sqlite://{quote(str(path.absolute()))}"


def minio_url(settings: Settings) -> str:
    """The URL of the MinIO ``FARM_MINIO_*`` describe. The endpoint is ``host:port``
    (TLS from ``FARM_MINIO_SECURE``) or a URL whose scheme says it
    (``https://host:port``)."""
    raw = settings.minio_endpoint
    if not raw:
        raise SettingsError("setting FARM_MINIO_ENDPOINT: not set")
    try:
        endpoint, secure = parse_endpoint(raw, settings.minio_secure)
    except ValueError as exc:
        raise SettingsError(f"setting FARM_MINIO_ENDPOINT: {exc}") from None
    return f"minio://{endpoint}/{settings.minio_bucket}" + ("?secure=true" if secure else "")
