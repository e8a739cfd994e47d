"""Which store a process uses: configuration, not another code path.

Without ``FARM_MINIO_ENDPOINT`` the environment's SQLite file is the store. With it, the
same SQLite file becomes the local tier in front of MinIO (the shared truth), so a
machine keeps what it loaded or compiled and a second run needs no network.
"""

from __future__ import annotations

from farm.core.outage import Waiter
from farm.core.settings import Settings
from farm.store.base import ArtifactStore
from farm.store.sqlite import SQLiteStore


def open_store(settings: Settings, *, remote_reads: Waiter | None = None) -> ArtifactStore:
    """The environment's store; MinIO credentials come only from ``settings``.

    ``remote_reads``: MinIO is read with signed GETs waited out by this waiter, and its
    SDK imported only for what else is asked (:mod:`farm.store.minio_reads`: a served
    application, which mostly reads)."""
    from farm.store.signing import with_signatures

    local = SQLiteStore(settings.store_path)
    if not settings.minio_endpoint:
        return with_signatures(local, settings)
    from farm.store.tiered import TieredStore

    remote: ArtifactStore
    try:
        if remote_reads is not None:
            from farm.store.minio_reads import MinioReads

            remote = MinioReads(settings, remote_reads)
        else:
            from farm.store.minio import MinioStore  # the minio SDK is an optional extra

            remote = MinioStore.from_settings(settings)
    except BaseException:
        local.close()
        raise
    return with_signatures(TieredStore([local, remote]), settings)
