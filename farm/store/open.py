"""Which store a process uses: configuration, not another code path.

Without ``FARM_MINIO_ENDPOINT`` the environment's SQLite file is the store. With it, the
same SQLite file becomes the local tier in front of MinIO (the shared truth), so a
machine keeps what it loaded or compiled and a second run needs no network.
"""

from __future__ import annotations

from farm.core.settings import Settings
from farm.store.base import ArtifactStore
from farm.store.sqlite import SQLiteStore


def open_store(settings: Settings) -> ArtifactStore:
    """The environment's store; MinIO credentials come only from ``settings``."""
    from farm.store.signing import with_signatures

    local = SQLiteStore(settings.store_path)
    if not settings.minio_endpoint:
        return with_signatures(local, settings)
    from farm.store.minio import MinioStore  # the minio SDK is an optional extra
    from farm.store.tiered import TieredStore

    try:
        remote = MinioStore.from_settings(settings)
    except BaseException:
        local.close()
        raise
    return with_signatures(TieredStore([local, remote]), settings)
