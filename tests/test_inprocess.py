"""The logic that matters most, in this process: a worker's obtain, and the client's
re-send of a dead worker's chunk.

rq's ``SimpleWorker`` is the model: the same code as in production, without the
processes. A worker's obtain is ``worker.execute`` on a ``WorkerState`` made here (this
process's OpenCL device, a memory store, real Redis leases); the client is the real
``ClusterClient`` against a real Redis, and the worker that serves it is Celery's own
worker on a thread (``celery.contrib.testing.worker``, solo pool) running the real
compile task. A mistake in these shows in seconds; the integration tests
(``test_cluster.py``, ``test_faults.py``) still run it all as separate processes.

One kernel is compiled for the whole module (a trivial one, the first compile of a
process costs most); every other case reuses its binary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from farm.cluster.lease import Leases, kernel_note
from farm.cluster.payloads import KernelRequest
from farm.cluster.workers import WorkerInfo
from farm.compilation.backend import OpenCLBackend
from farm.core.device import DeviceInfo, open_device, probe_devices, select_device
from farm.core.keys import Namespace, queue_name, task_holder_key, task_kernel_key, workers_key
from farm.core.model import Artifact, Key, LaunchSettings, Lowered
from farm.core.outage import redis_waiter
from farm.core.outcomes import Outcome
from farm.core.settings import Settings
from farm.families import Registry
from farm.families.base import Example, KernelFamily, Params
from farm.programs.request import ChunkRequest
from farm.records import Recorder
from farm.records.model import CompilationRecord, Record, Session
from farm.store import MemoryStore, PutResult
from farm.store.base import WrappedStore
from worker.execute import execute_job
from worker.kernel import obtain_kernel
from worker.state import WorkerState

pytestmark = pytest.mark.integration  # Redis, started by conftest as its own process


class ScaleParams(Params):
    factor: int = 2


class Scale(KernelFamily[ScaleParams]):
    """A trivial kernel (quick to compile); a negative factor lowers to broken C."""

    name = "inproc_scale"
    params_model = ScaleParams

    def lower(self, params: ScaleParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        body = "this is not C" if params.factor < 0 else f"x[get_global_id(0)] *= {params.factor}"
        return Lowered(source=f"__kernel void scale(__global float *x) {{ {body}; }}",
                       kernel_names=("scale",))

    def example(self, params: ScaleParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        x = rng.uniform(size=8).astype(np.float32)
        return Example("scale", [x], (8,), None, {0: x * params.factor})


REGISTRY = Registry([Scale()])
BUILD_ID = Scale().build_id


class ListSink:
    """A record sink in memory (the recorder's contract, nothing else)."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        pass

    def write_records(self, records: Sequence[Record]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass

    def outcomes(self) -> list[Outcome]:
        return [r.outcome for r in self.records if isinstance(r, CompilationRecord)]


class RecordedFirst(WrappedStore):
    """A memory store that notes, at every write, whether the write's record had
    reached the sink already (the worker's durability rule)."""

    def __init__(self, sink: ListSink) -> None:
        super().__init__(MemoryStore())
        self.sink = sink
        self.recorded_before_put: list[bool] = []

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        self.recorded_before_put.append(any(
            isinstance(r, CompilationRecord) and r.key == str(artifact.meta.key)
            for r in self.sink.records))
        return super().put(ns, artifact, source=source)


@pytest.fixture(scope="module")
def device() -> DeviceInfo:
    return select_device(probe_devices())


@pytest.fixture(scope="module")
def opened(device: DeviceInfo) -> tuple[Any, Any]:
    return open_device(device)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.close()


def make_state(device: DeviceInfo, opened: tuple[Any, Any], client: redis.Redis,
               url: str, store: WrappedStore | MemoryStore | None = None,
               sink: ListSink | None = None) -> WorkerState:
    settings = Settings(redis_url=url, native_binaries=False)
    sink = sink or ListSink()
    ctx, cl_device = opened
    return WorkerState(settings=settings, registry=REGISTRY, device=device,
                       backend=OpenCLBackend.on(device, ctx, cl_device),
                       store=store or RecordedFirst(sink),
                       leases=Leases(client, ttl_s=5), recorder=Recorder(sink, label="w"),
                       name="inproc:1", redis=None, redis_waiter=redis_waiter(url, 5))


def request(factor: int = 2, build_id: str = BUILD_ID) -> KernelRequest:
    return KernelRequest(artifact=Scale().artifact_id({"factor": factor}), build_id=build_id)


@pytest.fixture(scope="module")
def compiled(device: DeviceInfo, opened: tuple[Any, Any], redis_url: str
             ) -> tuple[Artifact, list[bool], list[Outcome]]:
    """The module's one compile, through the worker's obtain: the artifact it stored,
    whether its record came before the write, and the outcomes recorded."""
    client = redis.Redis.from_url(redis_url)
    sink = ListSink()
    store = RecordedFirst(sink)
    state = make_state(device, opened, client, redis_url, store, sink)
    reply = obtain_kernel(request(), state)
    assert reply.outcome is Outcome.COMPILED, reply.failure
    art = store.get(state.ns, Key.parse(reply.key or ""))
    assert art is not None
    client.close()
    return art, store.recorded_before_put, sink.outcomes()


def test_a_missing_kernel_is_compiled_recorded_before_it_is_stored(
        compiled: tuple[Artifact, list[bool], list[Outcome]]) -> None:
    art, recorded_first, outcomes = compiled
    assert art.verify() and art.meta.worker == "inproc:1" and art.meta.family == "inproc_scale"
    assert recorded_first == [True]
    assert outcomes == [Outcome.COMPILED]


def test_a_stored_kernel_is_loaded_and_nothing_is_written(
        compiled: tuple[Artifact, list[bool], list[Outcome]], device: DeviceInfo,
        opened: tuple[Any, Any], redis_client: redis.Redis, redis_url: str) -> None:
    state = make_state(device, opened, redis_client, redis_url)
    state.store.put(state.ns, compiled[0])
    store = state.store
    assert isinstance(store, RecordedFirst)
    writes = len(store.recorded_before_put)
    reply = obtain_kernel(request(), state)
    assert reply.outcome is Outcome.LOADED and reply.failure is None
    assert len(store.recorded_before_put) == writes  # a load writes nothing


def test_an_earlier_build_of_the_same_source_is_moved_not_compiled(
        compiled: tuple[Artifact, list[bool], list[Outcome]], device: DeviceInfo,
        opened: tuple[Any, Any], redis_client: redis.Redis, redis_url: str) -> None:
    sink = ListSink()
    state = make_state(device, opened, redis_client, redis_url, sink=sink)
    art = compiled[0]
    old = Key(id_hash=art.meta.key.id_hash, build_id="1" * 24)
    lowered = Scale().lower_id(request().artifact, device)
    state.store.put(state.ns, Artifact(meta=art.meta.model_copy(update={"key": old}),
                                       binary=art.binary), source=lowered)
    reply = obtain_kernel(request(), state)
    assert reply.outcome is Outcome.REKEYED, reply.failure
    assert set(state.store.keys(state.ns)) == {art.meta.key}  # moved: the old key went
    assert state.store.find_source(state.ns, lowered.source_hash) == art.meta.key
    assert sink.outcomes() == [Outcome.REKEYED]


def test_version_skew_fails_and_stores_nothing(
        device: DeviceInfo, opened: tuple[Any, Any], redis_client: redis.Redis,
        redis_url: str) -> None:
    state = make_state(device, opened, redis_client, redis_url)
    reply = obtain_kernel(request(build_id="f" * 24), state)
    assert reply.failure is not None and reply.failure.kind == "version-skew"
    assert f"client build id {'f' * 24}" in reply.failure.message
    assert list(state.store.keys(state.ns)) == []


def test_a_compile_error_fails_with_its_log_and_stores_nothing(
        device: DeviceInfo, opened: tuple[Any, Any], redis_client: redis.Redis,
        redis_url: str) -> None:
    state = make_state(device, opened, redis_client, redis_url)
    reply = obtain_kernel(request(factor=-1), state)
    assert reply.failure is not None and reply.failure.kind == "compile"
    assert "undeclared identifier" in reply.failure.build_log  # the compiler's own words
    assert list(state.store.keys(state.ns)) == []


def test_a_kernel_another_worker_is_compiling_is_waited_for_and_loaded(
        compiled: tuple[Artifact, list[bool], list[Outcome]], device: DeviceInfo,
        opened: tuple[Any, Any], redis_client: redis.Redis, redis_url: str) -> None:
    state = make_state(device, opened, redis_client, redis_url)
    lowered = Scale().lower_id(request().artifact, device)
    other = state.leases.try_acquire(state.ns, lowered.source_hash)  # the other worker
    assert other is not None

    def finish_elsewhere() -> None:
        time.sleep(0.2)
        state.store.put(state.ns, compiled[0], source=lowered)
        other.release()

    thread = threading.Thread(target=finish_elsewhere)
    thread.start()
    reply = execute_job(ChunkRequest(fingerprint=device.fingerprint, kernels=[request()]),
                        state).results[0]
    thread.join()
    assert reply.outcome is Outcome.LOADED, reply.failure  # compiled once, elsewhere


def test_a_dead_workers_chunk_is_sent_again_and_served_by_a_live_one(
        compiled: tuple[Artifact, list[bool], list[Outcome]], device: DeviceInfo,
        opened: tuple[Any, Any], redis_client: redis.Redis, redis_url: str,
        tmp_path: Path) -> None:
    from celery.contrib.testing.worker import start_worker

    from farm.cluster.celery_app import make_app
    from farm.cluster.client import BuildOptions, ClusterClient
    from worker.app import register_tasks

    settings = Settings(redis_url=redis_url, heartbeat_interval=0.1, dead_worker_grace=0.3,
                        chunk_size=1, native_binaries=False, home=tmp_path)
    fp = device.fingerprint
    # What the live worker serves from: the source is stored under another family's key,
    # so it obtains the kernel by rekeying (no compile), the same code all the same.
    worker_state = make_state(device, opened, redis_client, redis_url)
    lowered = Scale().lower_id(request().artifact, device)
    art = compiled[0]
    twin = Key(id_hash="e" * 32, build_id=BUILD_ID)
    worker_state.store.put(worker_state.ns, Artifact(
        meta=art.meta.model_copy(update={"key": twin, "family": "twin"}), binary=art.binary),
        source=lowered)
    # The dead worker: registered (so the fingerprint is served), never beats again.
    dead = WorkerInfo(host="deadhost", pid=1, fingerprint=fp, device_name=device.device_name,
                      processes=1, version="test", queues=[queue_name(fp)],
                      heartbeat=time.time(), device=device)
    redis_client.hset(workers_key(fp), dead.field, dead.model_dump_json())

    said: list[str] = []
    client = ClusterClient(settings, registry=REGISTRY, store=worker_state.store,
                           say=said.append)
    client.check_interval_s = 0.1
    reports: list[Any] = []
    build = threading.Thread(target=lambda: reports.append(client.build(
        [request().artifact], BuildOptions(fingerprint=fp, timeout_s=30))))
    build.start()
    taken = _take_one_task(settings, queue_name(fp))  # the dead worker took it...
    redis_client.set(task_holder_key(taken), dead.field)  # ...said so, and died
    redis_client.set("farm:lease:held-by-the-dead", "token")
    redis_client.set(task_kernel_key(taken),  # its note: the kernel in hand, its lease
                     kernel_note("", "farm:lease:held-by-the-dead", "token"))

    app = make_app(settings)
    app.conf.broker_transport_options = {**app.conf.broker_transport_options,
                                         "polling_interval": 0.1}  # a quick shutdown
    register_tasks(app, lambda: worker_state)
    with start_worker(app, perform_ping_check=False, queues=[queue_name(fp)],
                      shutdown_timeout=10):
        build.join(timeout=30)
    client.close()
    assert not build.is_alive()
    [report] = reports
    [result] = report.results
    assert result.outcome is Outcome.REKEYED and result.failure is None
    assert report.tasks_sent == 2  # the first send, and the re-send
    assert [line for line in said if "re-sent a chunk of 1 kernel(s)" in line
            and "deadhost:1" in line]
    assert redis_client.get("farm:lease:held-by-the-dead") is None  # released at once
    assert worker_state.store.get(worker_state.ns, art.meta.key) is not None


def _take_one_task(settings: Settings, queue: str) -> str:
    """Take the first task off ``queue`` and acknowledge it (so it never comes back),
    as a worker that dies right after would; its task id."""
    from kombu import Connection

    with Connection(settings.redis_url) as conn:
        q = conn.SimpleQueue(queue)
        message = q.get(block=True, timeout=10)
        message.ack()
        task_id = str(message.headers["id"])
        q.close()
    return task_id

