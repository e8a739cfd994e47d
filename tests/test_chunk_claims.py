"""A chunk's claims go out while its kernels compile (``worker.chunkrun``), against a
real MinIO and Redis: the compile starts before the claim is answered; a claim that
finds the source indexed discards that compile and reuses the indexed artifact (the
rules' outcome, Rekeyed, as if it had waited), even when the compile failed; the
build's later chunks on the process then wait for their claims and compile nothing
they throw away; a kernel whose compile fails leaves no index entry it claimed; a
chunk's first compile starts before its leases are answered, once its build was seen
alive (never for a build not seen: a dead client's chunk compiles nothing).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from test_inprocess import ListSink
from test_store_minio import make_store, new_bucket

from farm.cluster.lease import Leases
from farm.cluster.payloads import KernelRequest
from farm.compilation.finalize import FinalizeResult
from farm.compilation.load import LoadedBinary
from farm.core.device import DeviceInfo
from farm.core.keys import Namespace, build_alive_key, build_replies_key, source_object
from farm.core.model import Artifact, Key, LaunchSettings, Lowered
from farm.core.outage import Waiter, redis_waiter
from farm.core.outcomes import Outcome
from farm.core.settings import Settings
from farm.devservices import MinioServer
from farm.families import Registry
from farm.families.base import Example, KernelFamily, Params
from farm.programs.request import ChunkRequest
from farm.records import Recorder
from farm.store.base import ArtifactStore, WrappedStore
from worker.chunks import Delivery
from worker.execute import execute_job
from worker.state import WorkerState

pytestmark = pytest.mark.integration

DEVICE = DeviceInfo(
    platform_index=0, device_index=0, platform_name="Counted", platform_version="1",
    device_name="counted compiler", vendor="kernel-farm tests", device_version="1",
    driver_version="1", opencl_c_version="OpenCL C 1.2", max_work_group_size=256,
    max_work_item_sizes=(256, 256, 64), local_mem_size=32768, global_mem_size=1 << 30,
    max_compute_units=4, extensions=())


class TwinParams(Params):
    n: int = 0
    tag: str = ""


class Twins(KernelFamily[TwinParams]):
    """Kernels whose source depends on ``n`` only: two tags, two keys, one source."""

    name = "claim_twins"
    params_model = TwinParams

    def lower(self, params: TwinParams, launch: LaunchSettings, device: Any) -> Lowered:
        return Lowered(source=f"__kernel void twin() {{ /* {params.n} */ }}",
                       kernel_names=("twin",))

    def example(self, params: TwinParams, launch: LaunchSettings, rng: Any) -> Example:
        raise NotImplementedError


FAMILY = Twins()
REGISTRY = Registry([FAMILY])


class CountedBackend:
    """Compiles by returning the source's bytes; counts its compiles; ``started`` is set
    when one begins; a source holding ``broken`` does not compile."""

    def __init__(self) -> None:
        self.device = DEVICE
        self.compiles = 0
        self.started = threading.Event()
        self.broken = "\0"

    def finalize(self, lowered: Lowered, native: bool, ready: bool = True) -> FinalizeResult:
        self.compiles += 1
        self.started.set()
        if self.broken in lowered.source:
            return FinalizeResult(error="does not compile", build_log="line 1: no")
        return FinalizeResult(binary=b"BIN:" + lowered.source.encode(), validated=True)

    def load(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
        return LoadedBinary(program=None, names=kernel_names)  # type: ignore[arg-type]


class LateClaims(WrappedStore):
    """Answers a claim only once a compile has begun (or after two seconds), so that a
    compile made while the claim is out is seen to be."""

    def __init__(self, inner: ArtifactStore, backend: CountedBackend) -> None:
        super().__init__(inner)
        self.backend = backend
        self.answered_after_a_compile: list[bool] = []

    def claim_source(self, ns: Namespace, source_hash: str, key: Key
                     ) -> tuple[Key | None, bool]:
        self.answered_after_a_compile.append(self.backend.started.wait(2.0))
        return super().claim_source(ns, source_hash, key)


class LateLeases:
    """The outage waiter, answering a chunk's lease round trip only once a compile has
    begun (or after two seconds; the test clears ``started`` before each chunk), so that
    a compile made while it is out is seen to be."""

    def __init__(self, inner: Waiter, backend: CountedBackend) -> None:
        self.inner = inner
        self.backend = backend
        self.answered_after_a_compile: list[bool] = []

    def call(self, fn: Any) -> Any:
        if fn.__qualname__.startswith("ChunkRun._begin"):
            self.answered_after_a_compile.append(self.backend.started.wait(2.0))
        return self.inner.call(fn)


@pytest.fixture
def state(minio_server: MinioServer, redis_url: str) -> Iterator[WorkerState]:
    client = redis.Redis.from_url(redis_url)
    backend = CountedBackend()
    store = LateClaims(make_store(minio_server, new_bucket()), backend)
    made = WorkerState(settings=Settings(redis_url=redis_url), registry=REGISTRY,
                       device=DEVICE, backend=backend, store=store,
                       leases=Leases(client, ttl_s=30), recorder=Recorder(ListSink()),
                       name="claims:1", redis=client, redis_waiter=redis_waiter(redis_url, 5))
    yield made
    made.close()
    client.close()


def chunk(state: WorkerState, build: str, *kernels: tuple[int, str]) -> list[Any]:
    """Run one chunk of ``(n, tag)`` kernels of ``build`` (a live one); its replies."""
    client = state.client
    client.set(build_alive_key(build), "1", ex=60)
    client.xadd(build_replies_key(build), {"start": "1"})
    request = ChunkRequest(fingerprint=DEVICE.fingerprint, build=build, kernels=[
        KernelRequest(artifact=FAMILY.artifact_id({"n": n, "tag": tag}),
                      build_id=FAMILY.build_id) for n, tag in kernels])
    delivery = Delivery(task_id=str(uuid.uuid4()), build=build, worker="claims:1",
                        redelivered=False)
    reply = execute_job(request, state, delivery=delivery)
    assert delivery.pushed
    return reply.results


def index_a_twin(state: WorkerState, n: int) -> Key:
    """Store the kernel ``(n, "twin")``, indexed by its source: ``(n, anything)`` is
    then Rekeyed from it."""
    twin = FAMILY.artifact_id({"n": n, "tag": "twin"})
    key = Key(id_hash=twin.id_hash, build_id=FAMILY.build_id)
    lowered = FAMILY.lower_id(twin, DEVICE)
    state.store.put(state.ns, Artifact.create(key, FAMILY.name, b"TWIN", lowered.source_hash),
                    source=lowered)
    return key


def test_a_kernel_compiles_while_its_claim_is_out(state: WorkerState) -> None:
    store = state.store
    assert isinstance(store, LateClaims)
    [reply] = chunk(state, uuid.uuid4().hex, (1, "a"))
    assert reply.outcome is Outcome.COMPILED, reply.failure
    assert store.answered_after_a_compile == [True]  # the compile did not wait for it
    assert state.backend.compiles == 1  # type: ignore[attr-defined]
    key = Key.parse(reply.key)
    got = store.get(state.ns, key)
    assert got is not None and got.binary.startswith(b"BIN:")
    assert store.find_source(state.ns, FAMILY.lower_id(
        FAMILY.artifact_id({"n": 1, "tag": "a"}), DEVICE).source_hash) == key


def test_a_refused_claim_discards_the_compile_and_the_build_then_waits(
        state: WorkerState) -> None:
    backend = state.backend
    assert isinstance(backend, CountedBackend)
    index_a_twin(state, 2)
    index_a_twin(state, 3)
    build = uuid.uuid4().hex
    [first] = chunk(state, build, (2, "a"))
    assert first.outcome is Outcome.REKEYED, first.failure
    assert backend.compiles == 1  # compiled while the claim was out, then thrown away
    got = state.store.get(state.ns, Key.parse(first.key))
    assert got is not None and got.binary == b"TWIN"  # the indexed artifact, reused
    [second] = chunk(state, build, (3, "a"))  # the same build: the claim is waited for
    assert second.outcome is Outcome.REKEYED, second.failure
    assert backend.compiles == 1
    [other] = chunk(state, uuid.uuid4().hex, (4, "a"))  # another build compiles ahead
    assert other.outcome is Outcome.COMPILED and backend.compiles == 2


def test_a_compile_that_fails_while_the_source_is_indexed_is_not_a_failure(
        state: WorkerState) -> None:
    backend = state.backend
    assert isinstance(backend, CountedBackend)
    backend.broken = "/* 5 */"
    index_a_twin(state, 5)
    [reply] = chunk(state, uuid.uuid4().hex, (5, "a"))
    assert reply.outcome is Outcome.REKEYED and reply.failure is None
    assert backend.compiles == 1


def test_a_failed_compile_leaves_no_claimed_entry(state: WorkerState) -> None:
    backend = state.backend
    assert isinstance(backend, CountedBackend)
    backend.broken = "/* 6 */"
    [reply] = chunk(state, uuid.uuid4().hex, (6, "a"))
    assert reply.failure is not None and reply.failure.kind == "compile"
    assert "line 1: no" in reply.failure.build_log
    lowered = FAMILY.lower_id(FAMILY.artifact_id({"n": 6, "tag": "a"}), DEVICE)
    assert state.store.find_source(state.ns, lowered.source_hash) is None
    assert list(state.store.keys(state.ns)) == []
    inner = state.store.inner  # type: ignore[attr-defined]
    assert not list(inner._client.list_objects(inner.bucket, prefix=source_object(
        state.ns, lowered.source_hash)))


def test_the_first_compile_goes_ahead_of_the_leases_once_the_build_is_seen_alive(
        state: WorkerState) -> None:
    backend = state.backend
    assert isinstance(backend, CountedBackend)
    late = LateLeases(state.redis_waiter, backend)  # type: ignore[arg-type]
    state.redis_waiter = late  # type: ignore[assignment]
    build = uuid.uuid4().hex
    backend.started.clear()
    [first] = chunk(state, build, (7, "a"))  # the build not seen yet: leases first
    backend.started.clear()
    second = chunk(state, build, (8, "a"), (9, "a"))  # seen alive: compiled meanwhile
    assert [r.outcome for r in [first, *second]] == [Outcome.COMPILED] * 3
    assert late.answered_after_a_compile == [False, True]
    assert backend.compiles == 3  # each kernel once: the compile made ahead was kept
    for reply in (first, *second):
        assert state.store.get(state.ns, Key.parse(reply.key)) is not None
