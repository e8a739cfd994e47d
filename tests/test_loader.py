"""The loader: kernels from memory, the store tiers or a compile; threads; generations;
warm; records; and the README's application example (docs/LOADER.md), run as written.

Kept small: a module fixture compiles three kernels once into a seed store, and each
test starts from a copy of it.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import loader.tiers as kl
from farm.core.errors import UnsupportedFeature
from farm.core.generation import bump_generation
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactId, Key, LaunchSettings, Lowered
from farm.core.settings import Settings
from farm.families.run import check_example, run_example
from farm.records import Recorder
from farm.records.model import BatchCounts, Session, Trip
from farm.store import ArtifactStore, PutResult, SQLiteStore, TieredStore
from loader import ArtifactMissing, KernelLoader, UnknownKernelName

ROOT = Path(__file__).resolve().parents[1]

#: (family, params) of the kernels the seed store holds
SEEDED: list[tuple[str, dict[str, Any]]] = [
    ("elementwise_binary", {"op": "add"}),
    ("elementwise_unary", {"op": "relu"}),
    ("softmax", {"cols": 128}),
]
#: a kernel the seed store lacks
UNSEEDED: tuple[str, dict[str, Any]] = ("elementwise_binary", {"op": "mul"})


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
class _NullSink:
    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        pass

    def write_records(self, records: Any) -> None:
        pass

    def close(self) -> None:
        pass


class SpyRecorder(Recorder):
    """A real recorder (its rules apply) that also lists what it was asked to record."""

    def __init__(self) -> None:
        super().__init__(_NullSink(), label="test")
        self.compilations: list[Trip] = []
        self.batches: list[BatchCounts] = []

    def compilation(self, trip: Trip, lowered: Lowered | None = None) -> Any:
        self.compilations.append(trip)
        return super().compilation(trip, lowered)

    def batch(self, counts: BatchCounts, **kwargs: Any) -> Any:
        self.batches.append(counts)
        return super().batch(counts, **kwargs)

    def outcomes(self) -> Counter[str]:
        return Counter(str(c.outcome) for c in self.compilations)


class CountingStore(ArtifactStore):
    """Delegates to a store and counts every call (to prove a memory hit touches none)."""

    def __init__(self, inner: ArtifactStore) -> None:
        super().__init__()
        self.inner = inner
        self.calls: Counter[str] = Counter()

    @property
    def location(self) -> str:
        return self.inner.location

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        self.calls["get"] += 1
        return self.inner.get(ns, key)

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        self.calls["put"] += 1
        return self.inner.put(ns, artifact, source=source)

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        self.calls["existing"] += 1
        return self.inner.existing(ns, keys)

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        self.calls["find_source"] += 1
        return self.inner.find_source(ns, source_hash)

    def delete(self, ns: Namespace, key: Key) -> None:
        self.calls["delete"] += 1
        self.inner.delete(ns, key)

    def keys(self, ns: Namespace) -> Iterator[Key]:
        self.calls["keys"] += 1
        return self.inner.keys(ns)

    def namespaces(self) -> list[Namespace]:
        self.calls["namespaces"] += 1
        return self.inner.namespaces()

    def close(self) -> None:
        self.inner.close()


def settings_for(home: Path) -> Settings:
    """Embedded settings in ``home``, whatever FARM_* the shell has."""
    return Settings(home=home, workers=0, redis_url=None, minio_endpoint=None,
                    device=None, records_url=None)


@pytest.fixture(scope="module")
def seed_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store file holding the SEEDED kernels, compiled once by a loader."""
    home = tmp_path_factory.mktemp("seed")
    settings = settings_for(home)
    with KernelLoader(settings) as loader:
        for family, params in SEEDED:
            loader.kernel(family, params)
        assert loader.stats.compiled == len(SEEDED)
    return settings.store_path


@pytest.fixture
def seeded(seed_store: Path, tmp_path: Path) -> Settings:
    """Settings of a fresh environment whose store is a copy of the seed store."""
    settings = settings_for(tmp_path / "home")
    settings.store_path.parent.mkdir(parents=True)
    shutil.copy(seed_store, settings.store_path)
    return settings


def example_of(loader: KernelLoader, family: str, params: dict[str, Any]) -> Any:
    fam = loader.registry.get(family)
    return fam.example(fam.validate(params), LaunchSettings(), np.random.default_rng(7))


# ----------------------------------------------------------------------------------------
# one kernel at a time
# ----------------------------------------------------------------------------------------
def test_kernels_from_the_local_tier_run_and_match_numpy(seeded: Settings) -> None:
    spy = SpyRecorder()
    with KernelLoader(seeded, recorder=spy) as loader:
        for family, params in SEEDED:
            kernel = loader.kernel(family, params)
            example = example_of(loader, family, params)
            assert check_example(run_example(loader.queue, kernel, example), example) == []
        stats = loader.stats.snapshot()
    assert stats["local"] == len(SEEDED) and stats["loads"] == len(SEEDED)
    assert stats["compiled"] == 0 and stats["compiler_invocations"] == 0
    assert spy.outcomes() == {"Loaded": len(SEEDED)} and spy.batches == []


def test_second_call_is_a_memory_hit_with_no_store_access(seeded: Settings) -> None:
    store = CountingStore(SQLiteStore(seeded.store_path))
    family, params = SEEDED[0]
    with KernelLoader(seeded, store=store, recorder=SpyRecorder()) as loader:
        first = loader.kernel(family, params)
        calls = sum(store.calls.values())
        assert calls >= 1
        second = loader.kernel(family, params)
        assert sum(store.calls.values()) == calls
        assert loader.stats.memory == 1
        assert first is not second  # a fresh Kernel per call: set_args is per object
        assert loader.program(family, params) is loader.program(family, params)
    store.close()


def test_switching_environment_serves_nothing_of_the_old_one(seeded: Settings) -> None:
    """The seeded environment holds the kernel; another (empty) one does not: after a
    switch the loader neither serves it from memory nor finds it, and after switching
    back it loads it from the first environment's store again."""
    family, params = SEEDED[0]
    with KernelLoader(seeded, on_miss="fail") as loader:
        loader.kernel(family, params)
        aid = loader.artifact_id(family, params)
        assert loader.cached(aid)
        loader.switch_environment("other")
        assert loader.settings.environment == "other" and not loader.cached(aid)
        with pytest.raises(ArtifactMissing):
            loader.kernel(family, params)
        loader.switch_environment(seeded.environment)
        loader.kernel(family, params)
        assert loader.stats.local == 2 and loader.stats.memory == 0
    assert (seeded.home / "envs" / "other").is_dir()


def test_a_loader_given_its_store_cannot_switch(seeded: Settings) -> None:
    from farm.core.errors import SettingsError

    with KernelLoader(seeded, store=SQLiteStore(seeded.store_path),
                      recorder=SpyRecorder()) as loader, pytest.raises(SettingsError):
        loader.switch_environment("other")


def test_generation_bump_drops_the_cache(seeded: Settings) -> None:
    store = CountingStore(SQLiteStore(seeded.store_path))
    family, params = SEEDED[0]
    with KernelLoader(seeded, store=store, recorder=SpyRecorder()) as loader:
        loader.kernel(family, params)
        aid = loader.artifact_id(family, params)
        assert loader.cached(aid)
        gets = store.calls["get"]
        bump_generation()
        assert not loader.cached(aid)
        loader.kernel(family, params)
        assert store.calls["get"] == gets + 1
        assert loader.stats.loads == 2 and loader.stats.memory == 0
    store.close()


def test_threads_asking_for_one_kernel_load_it_once(seeded: Settings,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[int] = []
    real_load = kl.load_binary

    def slow_counting_load(*args: Any, **kwargs: Any) -> Any:
        loads.append(threading.get_ident())
        time.sleep(0.2)  # keep the first trip in flight while the others arrive
        return real_load(*args, **kwargs)

    monkeypatch.setattr(kl, "load_binary", slow_counting_load)
    spy = SpyRecorder()
    family, params = SEEDED[1]
    n = 8
    barrier = threading.Barrier(n)
    kernels: list[Any] = []
    errors: list[BaseException] = []

    with KernelLoader(seeded, recorder=spy) as loader:
        def ask() -> None:
            barrier.wait()
            try:
                kernels.append(loader.kernel(family, params))
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = loader.stats.snapshot()
    assert errors == []
    assert len(loads) == 1, "fetched and loaded once"
    assert stats["local"] == 1 and stats["joined"] + stats["memory"] == n - 1
    assert len({id(k) for k in kernels}) == n
    assert spy.outcomes() == {"Loaded": 1}


def test_full_miss_compiles_then_stores_after_the_load(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import farm.compilation.batch

    settings = settings_for(tmp_path / "home")
    events: list[str] = []
    real_load, real_put = farm.compilation.batch.load_binary, SQLiteStore.put

    def load(*args: Any, **kwargs: Any) -> Any:
        program = real_load(*args, **kwargs)
        events.append("load")
        return program

    def put(self: SQLiteStore, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        events.append("put")
        return real_put(self, ns, artifact, source=source)

    monkeypatch.setattr(farm.compilation.batch, "load_binary", load)
    monkeypatch.setattr(SQLiteStore, "put", put)
    spy = SpyRecorder()
    family, params = UNSEEDED
    with KernelLoader(settings, recorder=spy) as loader:
        kernel = loader.kernel(family, params)
        example = example_of(loader, family, params)
        assert check_example(run_example(loader.queue, kernel, example), example) == []
        key = loader.key_of(loader.artifact_id(family, params))
        ns = loader.namespace
        assert loader.stats.compiled == 1 and loader.stats.compiler_invocations == 1
    assert events == ["load", "put"]
    assert spy.outcomes() == {"Compiled": 1} and spy.batches == []
    with _open(settings) as store:
        stored = store.get(ns, key)
        assert stored is not None and stored.meta.origin == "compiled"


class _open:
    """A SQLite store as a context manager (the store itself is not one)."""

    def __init__(self, settings: Settings) -> None:
        self.store = SQLiteStore(settings.store_path)

    def __enter__(self) -> SQLiteStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def test_on_miss_fail_raises_and_records_nothing(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "home")
    spy = SpyRecorder()
    family, params = UNSEEDED
    with KernelLoader(settings, on_miss="fail", recorder=spy) as loader, \
            pytest.raises(ArtifactMissing) as caught:
        loader.kernel(family, params)
    assert "elementwise_binary(dtype=float,op=mul,width=1)" in str(caught.value)
    assert "on_miss='fail'" in str(caught.value)
    assert spy.compilations == [] and spy.held == 0
    with _open(settings) as store:
        assert store.namespaces() == []


def test_a_missing_kernel_is_named_with_its_launch_settings(seeded: Settings) -> None:
    """The launch is part of the key: a kernel stored without a local size is not the
    one asked for with one, and the error says which was asked for."""
    family, params = SEEDED[0]
    with KernelLoader(seeded, on_miss="fail", recorder=SpyRecorder()) as loader:
        loader.kernel(family, params)  # stored, without a launch
        with pytest.raises(ArtifactMissing) as caught:
            loader.kernel(family, params, launch=LaunchSettings(local_size=(8,)))
    assert f"{family}(" in str(caught.value) and "local_size=[8]" in str(caught.value)


def test_a_kernel_the_device_cannot_run_raises_unsupported(tmp_path: Path) -> None:
    spy = SpyRecorder()
    with KernelLoader(settings_for(tmp_path / "home"), recorder=spy) as loader, \
            pytest.raises(UnsupportedFeature, match="work-group size"):
        too_big = loader.device.max_work_group_size * 2
        loader.kernel("elementwise_binary", {"op": "add"},
                      launch=LaunchSettings(local_size=(too_big,)))
    assert spy.compilations == [] and loader.stats.failures == 1


def test_unknown_kernel_name_is_a_clear_error(seeded: Settings) -> None:
    family, params = SEEDED[0]
    with KernelLoader(seeded, recorder=SpyRecorder()) as loader:
        assert loader.kernel(family, params, name="binary_add").function_name == "binary_add"
        with pytest.raises(UnknownKernelName, match="binary_add"):
            loader.kernel(family, params, name="nope")


# ----------------------------------------------------------------------------------------
# tiers
# ----------------------------------------------------------------------------------------
def test_remote_hit_is_loaded_then_copied_into_the_local_tier(seeded: Settings,
                                                              tmp_path: Path) -> None:
    local = SQLiteStore(tmp_path / "local.sqlite")
    remote = SQLiteStore(seeded.store_path)  # stands in for MinIO: the last tier
    tiered = TieredStore([local, remote])
    with KernelLoader(seeded, store=tiered, recorder=SpyRecorder()) as loader:
        assert [t.name for t in loader.tiers] == ["local", "remote"]
        family, params = SEEDED[0]
        loader.kernel(family, params)
        key = loader.key_of(loader.artifact_id(family, params))
        assert loader.stats.remote == 1
        assert local.get(loader.namespace, key) is not None
        report = loader.warm([loader.artifact_id(f, p) for f, p in SEEDED])
        assert (report.count("memory"), report.count("remote")) == (1, len(SEEDED) - 1)
        assert set(local.keys(loader.namespace)) == set(remote.keys(loader.namespace))
    tiered.close()


def test_corrupt_local_copy_falls_through_and_is_repaired(seeded: Settings,
                                                          tmp_path: Path) -> None:
    local_path = tmp_path / "local.sqlite"
    shutil.copy(seeded.store_path, local_path)
    conn = sqlite3.connect(local_path)
    conn.execute("UPDATE artifacts SET binary = X'00112233'")
    conn.commit()
    conn.close()
    tiered = TieredStore([SQLiteStore(local_path), SQLiteStore(seeded.store_path)])
    with KernelLoader(seeded, store=tiered, recorder=SpyRecorder()) as loader:
        report = loader.warm([loader.artifact_id(f, p) for f, p in SEEDED])
        assert report.count("remote") == len(SEEDED) and report.failed == []
        for family, params in SEEDED:
            key = loader.key_of(loader.artifact_id(family, params))
            assert tiered.tiers[0].get(loader.namespace, key) is not None
    tiered.close()


# ----------------------------------------------------------------------------------------
# warm
# ----------------------------------------------------------------------------------------
def test_warm_records_one_batch_and_says_where_each_kernel_came_from(seeded: Settings) -> None:
    spy = SpyRecorder()
    with KernelLoader(seeded, recorder=spy) as loader:
        artifacts: list[ArtifactId] = [loader.artifact_id(f, p) for f, p in [*SEEDED, UNSEEDED]]
        seen: list[str] = []
        report = loader.warm(artifacts, progress=lambda item: seen.append(str(item.source)))
        s = report.summary()
        assert (s["local"], s["compiled"], s["failed"], s["kernels"]) == (3, 1, 0, 4)
        assert s["compiler_invocations"] == 1 and len(seen) == 4
        assert set(s["phases"]) == {"lookup", "fetch", "load", "compile", "launch"}
        assert s["phases"]["launch"]["kernels"] == 0 and s["readiness"] == {"kernels": 0}
        assert s["phases"]["fetch"]["kernels"] == 3 and s["phases"]["compile"]["kernels"] == 1
        assert spy.outcomes() == {"Loaded": 3, "Compiled": 1}
        assert len(spy.batches) == 1 and spy.batches[0].kernels == 4
        assert spy.batches[0].compiled == 1 and spy.batches[0].loaded == 3

        again = loader.warm(artifacts)
        assert again.count("memory") == 4 and again.compiler_invocations == 0
        assert len(spy.compilations) == 4 and len(spy.batches) == 2
        for family, params in SEEDED:  # everything warmed is served from memory now
            loader.kernel(family, params)
        assert loader.stats.memory == 4 + len(SEEDED)


def test_warm_with_on_miss_fail_reports_the_missing(seeded: Settings) -> None:
    with KernelLoader(seeded, on_miss="fail", recorder=SpyRecorder()) as loader:
        report = loader.warm([loader.artifact_id(f, p) for f, p in [SEEDED[0], UNSEEDED]])
        assert report.count("local") == 1 and len(report.failed) == 1
        failure = report.failed[0].failure
        assert failure is not None and "on_miss='fail'" in failure.message
        with pytest.raises(ArtifactMissing):  # a later ask is a fresh trip, and fails too
            loader.kernel(*UNSEEDED)


# ----------------------------------------------------------------------------------------
# the README's example, exactly as docs/LOADER.md writes it
# ----------------------------------------------------------------------------------------
def test_loader_md_example_runs_as_written(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "docs" / "LOADER.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/LOADER.md has no python block"
    monkeypatch.setenv("FARM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FARM_WORKERS", "0")
    for name in ("FARM_MINIO_ENDPOINT", "FARM_REDIS_URL", "FARM_DEVICE", "FARM_RECORDS_URL",
                 "FARM_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)
    exec(compile(blocks[0], "docs/LOADER.md", "exec"), {"__name__": "loader_md"})
    # and the second run (a new process would do the same) loads it from the local tier
    exec(compile(blocks[0], "docs/LOADER.md", "exec"), {"__name__": "loader_md"})
    assert (tmp_path / "home" / "envs" / "default" / "store.sqlite").exists()


def test_warm_reads_every_artifact_while_the_context_is_still_being_made(
        seeded: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a context takes seconds: warm reads (and verifies) the stored artifacts
    meanwhile, and only the loads wait for it."""
    import farm.core.device

    real_open = farm.core.device.open_device
    context_made: list[float] = []

    def slow_open(info: Any) -> Any:
        time.sleep(0.6)
        opened = real_open(info)
        context_made.append(time.perf_counter())
        return opened

    reads: list[float] = []
    real_get = SQLiteStore.get
    seeded_store = str(seeded.store_path)

    def timed_get(self: SQLiteStore, ns: Namespace, key: Key) -> Artifact | None:
        found = real_get(self, ns, key)
        # this loader's store only: a thread an earlier test left may read its own
        if self.location.endswith(seeded_store):
            reads.append(time.perf_counter())
        return found

    monkeypatch.setattr(farm.core.device, "open_device", slow_open)
    monkeypatch.setattr(SQLiteStore, "get", timed_get)
    with KernelLoader(seeded, on_miss="fail", recorder=SpyRecorder()) as loader:
        report = loader.warm([loader.artifact_id(f, p) for f, p in SEEDED], threads=1)
        assert report.count("local") == len(SEEDED) and report.failed == []
        for family, params in SEEDED:  # loaded in the loader's own (slow-made) context
            example = example_of(loader, family, params)
            kernel = loader.kernel(family, params)
            assert check_example(run_example(loader.queue, kernel, example), example) == []
    assert len(context_made) == 1 and len(reads) == len(SEEDED)
    assert max(reads) < context_made[0], "a read waited for the context"
