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
    """The cluster as one process's hook sees it: one client, made on first use, kept."""

    def __init__(self, settings: Settings, store: ArtifactStore) -> None:
        from farm.cluster.client import ClusterClient
        from farm.families import Registry

        self.client = ClusterClient(settings, registry=Registry(), store=store)

    def build(self, fingerprint: str, described: Described) -> Artifact | None:
        """The artifact the cluster compiled and stored; ``None``: compile here."""
        from farm.programs.request import ChunkRequest, ProgramRequest

        try:
            self.client.served(fingerprint)
        except ClusterError:
            return None
        store = self.client.store
        for data in described.blobs().values():
            store.put_blob(data)
        spec = described.spec
        result = KernelResult(artifact=handle(spec), key=spec.key)
        request = ChunkRequest(fingerprint=fingerprint, programs=[ProgramRequest(spec=spec)])
        self.client.send(fingerprint, [(request, [result])], timeout_s=REMOTE_TIMEOUT_S)
        if result.failure is not None:
            if result.failure.kind == "compile":
                raise RemoteRefused(result.failure.message)
            return None
        return store.get(Namespace.for_fingerprint(fingerprint), spec.key)

    def close(self) -> None:
        self.client.close()
