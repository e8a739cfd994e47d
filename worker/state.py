"""What one worker process holds for its whole life: made once, at process start.

Creating an OpenCL context costs up to seconds, compiling a kernel tens to hundreds of
milliseconds, so a context per task would dominate everything. Each pool process opens
its device (spread round-robin over the devices of its fingerprint), its store
connection, its lease client and its records session exactly once.
"""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from farm.cluster.lease import Also, Leases
from farm.compilation.backend import DeviceBackend, OpenCLBackend, open_backend
from farm.compilation.finalize import worker_name
from farm.compilation.load import LoadedBinary
from farm.compilation.obtain import Obtainer, compiled_artifact
from farm.compilation.proofs import ProofBook, Prover, prove_family
from farm.core.device import DeviceInfo
from farm.core.errors import CompileError, FarmError, LoadError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.core.outage import Waiter, redis_client, redis_waiter
from farm.core.settings import Settings
from farm.families import Registry
from farm.records import Recorder
from farm.store import ArtifactStore
from worker.chunks import BuildWatch

if TYPE_CHECKING:
    import pyopencl as cl
    import redis
    from redis import Redis

    from worker.crashes import InHand, TaskLedger

log = logging.getLogger(__name__)

#: a chunk's store requests sent at once (a chunk of the default 4 kernels sends 4)
IO_THREADS = 8
#: how long to wait for another worker's compile (its lease) before taking over
LEASE_WAIT_S = 600.0


@dataclass
class WorkerState:
    settings: Settings
    registry: Registry
    device: DeviceInfo
    #: compiles and loads on the device (OpenCL; a simulated one in the control-plane
    #: benchmark: farm/compilation/backend.py)
    backend: DeviceBackend
    store: ArtifactStore
    leases: Leases
    recorder: Recorder
    name: str
    #: the farm's Redis (leases, crash bookkeeping) and the waiter of its outages
    redis: redis.Redis | None = None
    redis_waiter: Waiter | None = None
    #: the running task's crash bookkeeping (a pool process runs one task at a time)
    ledger: TaskLedger | None = None
    #: where this process notes the kernel in hand for its main process (a worker's
    #: pool process: ``worker.crashes.InHand``; ``None`` elsewhere)
    in_hand: InHand | None = None
    #: what this process read of the builds whose chunks it runs (``worker.chunks``)
    builds: BuildWatch = field(default_factory=BuildWatch)

    @cached_property
    def fingerprint(self) -> str:
        """The device's (a hash of its identity: computed once, not per chunk)."""
        return self.device.fingerprint

    @cached_property
    def ns(self) -> Namespace:
        return Namespace.for_fingerprint(self.fingerprint)

    @cached_property
    def host(self) -> str:
        return socket.gethostname()

    @property
    def client(self) -> Redis:
        """The Redis client of a chunk's round trips (the leases' when the state has no
        client of its own, as in a test's)."""
        return self.redis if self.redis is not None else self.leases.client

    @cached_property
    def io(self) -> ThreadPoolExecutor:
        """Threads for a chunk's store requests, sent at once (its look-ups, its writes)."""
        return ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="store-io")

    @cached_property
    def rules(self) -> Obtainer:
        """The obtain rules here: every artifact found is proven on this node (its book,
        else a child process) and then loaded on this device (docs/SECURITY.md): a
        binary that crashes the driver costs the child, not this pool process and the
        task it holds."""
        validate = self._validate if isinstance(self.backend, OpenCLBackend) else None
        return Obtainer(self.store, self.ns, self._load, validate=validate)

    @cached_property
    def prover(self) -> Prover:
        """The proofs of stored binaries on this node (its child starts on first use)."""
        return Prover(self.device, ProofBook(self.settings.home))

    def _validate(self, art: Artifact, kernel_names: tuple[str, ...]) -> str:
        return prove_family(self.prover, art, kernel_names)

    def _load(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
        return self.backend.load(binary, kernel_names)

    @property
    def ctx(self) -> cl.Context:
        """The OpenCL context, for what only OpenCL does (an application's programs)."""
        return self._opencl().ctx

    @property
    def cl_device(self) -> cl.Device:
        return self._opencl().cl_device

    def _opencl(self) -> OpenCLBackend:
        if not isinstance(self.backend, OpenCLBackend):
            raise FarmError("this worker's device is simulated (FARM_DEVICE_BACKEND): it "
                            "has no OpenCL context for programs")
        return self.backend

    def lease_note(self, id_hash: str) -> Also | None:
        """What the round trip taking a lease for ``id_hash`` adds: the crash ledger's
        note of the kernel (or program) in hand and of that lease."""
        ledger = self.ledger
        if ledger is None:
            return None

        def note(pipe: Any, name: str, token: str) -> None:
            ledger.note(pipe, id_hash, name, token)
        return note

    def compile(self, key: Key, family: str, lowered: Lowered, source_hash: str) -> Artifact:
        """Finalize on this device and validate by a load: a refused binary is never
        stored (a ``KernelError``: ``CompileError`` or ``LoadError``, with its log)."""
        built = self.backend.finalize(lowered, self.settings.native_binaries,
                                      self.settings.pocl_ready)
        if not built.ok:
            error = LoadError if built.error_kind == "load" else CompileError
            raise error(built.error, build_log=built.build_log)
        return compiled_artifact(key, family, built, source_hash, worker=self.name)

    def send_records(self) -> None:
        """Send the records now, waiting out a Redis outage (``OutageError`` past the
        limit): what a compile or rekey does *before* the store is written."""
        if self.redis_waiter is None:
            self.recorder.flush()
            return
        self.redis_waiter.call(self.recorder.flush)

    def flush_records(self) -> None:
        """Send the records now, best effort: on failure the recorder keeps them and
        the next flush sends them (a chunk's end, where only Loaded records wait)."""
        try:
            self.recorder.flush()
        except Exception as exc:  # Redis away: kept, sent with the next flush
            log.warning("records not sent yet (%s); kept for the next try", exc)

    def close(self) -> None:
        if "io" in self.__dict__:
            self.io.shutdown(wait=False)
        if self.in_hand is not None:
            self.in_hand.close()
        self.recorder.close()
        self.store.close()
        if "prover" in self.__dict__:  # started: end its child
            self.prover.close()


def open_state(settings: Settings, devices: list[DeviceInfo], index: int) -> WorkerState:
    """Open process ``index``'s device (round-robin over ``devices``) and connections."""
    from farm.cluster.metrics import InstrumentedStore, TimedLeases
    from farm.records.open import open_recorder
    from farm.store.open import open_store

    device = devices[index % len(devices)]
    backend = open_backend(settings, device)
    assert settings.redis_url, "a worker needs FARM_REDIS_URL"
    client = redis_client(settings.redis_url, settings.socket_timeout)
    waiter = redis_waiter(settings.redis_url, settings.outage_limit)
    return WorkerState(
        settings=settings, registry=Registry.load(settings.family_modules), device=device,
        backend=backend,
        # no request at process start: the main process checks the store before it
        # consumes (worker.readiness), and a process start must not wait on MinIO
        store=InstrumentedStore(open_store(settings, shared=True, create=False),
                                tier="minio"),
        leases=TimedLeases(client, ttl_s=settings.lease_ttl, waiter=waiter),
        recorder=open_recorder(settings, label=f"worker {worker_name()}"),
        name=worker_name(), redis=client, redis_waiter=waiter)
