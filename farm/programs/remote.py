"""A program no store tier holds, compiled on the cluster's pool for its fingerprint
(``FARM_PROGRAMS_ON_MISS=farm``), for an application the hook serves.

The source, its headers and its spec go into the store as blobs (MinIO, the store the
workers read), one task carries the spec, and the worker that takes it compiles,
validates and stores the binary (``worker.programs``); this process then reads it from
the store like any stored program. When no live worker serves the fingerprint the
program is compiled here instead (:data:`None`); a source the worker's compiler refused
raises :class:`RemoteRefused`, so that pyopencl builds it itself and raises its own
error.
"""

from __future__ import annotations

from typing import Any

from farm.compilation.batch import KernelResult
from farm.core.errors import ClusterError
from farm.core.keys import Namespace
from farm.core.model import Artifact
from farm.core.settings import Settings
from farm.programs.prebuild import handle
from farm.programs.spec import Described
from farm.store.base import ArtifactStore

#: seconds an application waits for the cluster's compile of one program
REMOTE_TIMEOUT_S = 600.0


class RemoteRefused(Exception):
    """The worker's compiler refused the source."""


class Remote:
    """The cluster as one process's hook sees it: made on first use, kept."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._app: Any = None

    def build(self, store: ArtifactStore, fingerprint: str,
              described: Described) -> Artifact | None:
        """The artifact the cluster compiled and stored; ``None``: compile here."""
        import redis

        from farm.cluster.build import Gatherer, check_served
        from farm.cluster.payloads import CompileRequest, ProgramRequest

        client: Any = redis.Redis.from_url(self.settings.redis_url or "", socket_timeout=5,
                                           socket_connect_timeout=2)
        try:
            check_served(client, fingerprint, self.settings.dead_worker_grace)
        except ClusterError:
            return None
        finally:
            client.close()
        for data in described.blobs().values():
            store.put_blob(data)
        spec = described.spec
        result = KernelResult(artifact=handle(spec), key=spec.key)
        gather = Gatherer(self.settings, app=self._celery, fingerprint=fingerprint,
                          notify=lambda r: None, say=None, status=None, waiter=None)
        try:
            payload = CompileRequest(fingerprint=fingerprint,
                                     programs=[ProgramRequest(spec=spec)])
            gather.send(payload.model_dump(mode="json"), [result])
            gather.run(REMOTE_TIMEOUT_S)
        finally:
            gather.close()
        if result.failure is not None:
            if result.failure.kind == "compile":
                raise RemoteRefused(result.failure.message)
            return None
        return store.get(Namespace.for_fingerprint(fingerprint), spec.key)

    def _celery(self) -> Any:
        if self._app is None:
            from farm.cluster.celery_app import make_app

            self._app = make_app(self.settings)
        return self._app
