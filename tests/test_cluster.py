"""The cluster for real: Redis, MinIO and Celery workers as separate processes.

Each test builds kernels whose sources are unique to it (``write_manifest`` salts the
shapes), so tests share one pair of workers without seeing each other's artifacts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import (
    build_json,
    farm,
    minio_store,
    namespace,
    next_redis_db,
    write_manifest,
)

from farm.compilation.poclbin import kernel_files
from farm.core.model import Key
from farm.devservices.cluster import LocalCluster, local_cluster
from farm.families import Registry
from farm.manifest import expand, load_manifest

pytestmark = pytest.mark.integration

# Short limits so that a killed worker's task comes back within seconds.
LIMITS = {"FARM_COMPILE_SOFT_TIME_LIMIT": "20", "FARM_COMPILE_HARD_TIME_LIMIT": "25",
          "FARM_VISIBILITY_TIMEOUT": "30", "FARM_LEASE_TTL": "5", "FARM_CHUNK_SIZE": "2"}

SKEW_FAMILY = '''
"""A user family for the version-skew test ({tag})."""
import numpy as np
from farm.families.base import Example, KernelFamily, Params
from farm.core.model import Lowered


class ScaleParams(Params):
    factor: int = 2


class Scale(KernelFamily[ScaleParams]):
    name = "skew_scale"
    params_model = ScaleParams

    def lower(self, params, launch, device):
        return Lowered(source=(
            "__kernel void scale(__global float *x) {{ x[get_global_id(0)] *= "
            + str(params.factor) + ".0f; }}"), kernel_names=("scale",))

    def example(self, params, launch, rng):
        x = rng.uniform(size=8).astype(np.float32)
        return Example("scale", [x], (8,), None, {{0: x * params.factor}})


FAMILIES = [Scale]
'''


def _skew_module(root: Path, tag: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "skewfam.py").write_text(SKEW_FAMILY.format(tag=tag))
    return root


@pytest.fixture(scope="module")
def cluster(redis_server: Any, minio_server: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("cluster")
    workers_code = _skew_module(work / "workers-code", "workers")
    with local_cluster(work, redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       PYTHONPATH=str(workers_code),
                       FARM_FAMILY_MODULES='["skewfam"]', **LIMITS) as c:
        c.start_worker()
        c.start_worker()
        c.wait_ready()
        yield c


def _keys(manifest: Path, env_modules: list[str] | None = None) -> list[Key]:
    registry = Registry.load(env_modules or [])
    return [Key(id_hash=e.artifact.id_hash,
                build_id=registry.get(e.family).build_id)
            for e in expand(load_manifest(manifest), registry)]


def test_build_spreads_over_both_workers_and_a_fresh_client_loads_all(
        cluster: LocalCluster, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", salt=11, count=8)
    first = build_json(cluster.env(tmp_path / "client-a"), str(manifest))
    assert first["summary"]["compiled"] == 8, first
    assert first["summary"]["failed"] == 0
    assert first["summary"]["store_hits"] == 0  # the client found nothing stored
    assert len(first["workers"]) == 2, first["workers"]  # both workers did work

    store = minio_store(cluster)
    ns = namespace(first["fingerprint"])
    keys = _keys(manifest)
    for key in keys:  # every artifact is in MinIO, and its digest verifies
        art = store.get(ns, key)
        assert art is not None
        # made ready by the worker that compiled it (PoCL): its launch's machine code,
        # no generic work-group function (docs/DESIGN.md, "Ready artifacts on PoCL")
        (files,) = kernel_files(art.binary).values()
        assert [f.split("/")[-2] for f in files] == ["64-1-1-goffs0-smallgrid"], files
    assert store.stats.corrupt == 0

    second = build_json(cluster.env(tmp_path / "client-b"), str(manifest))
    assert second["summary"]["loaded"] == 8
    assert second["summary"]["tasks_sent"] == 0
    assert second["summary"]["store_hits"] == 8  # all found by the client itself
    assert second["summary"]["compiled"] == 0


def test_overlapping_builds_compile_each_shared_kernel_once(cluster: LocalCluster,
                                                            tmp_path: Path) -> None:
    a = write_manifest(tmp_path / "a.toml", salt=12, count=10)
    # The same kernels in the opposite order, so the two builds meet in the middle.
    text = a.read_text().split("[[kernels]]")
    b = tmp_path / "b.toml"
    b.write_text(text[0].replace("salted-12", "salted-12-rev") + "[[kernels]]"
                 + "[[kernels]]".join(reversed(text[1:])))
    procs = [subprocess.Popen([sys.executable, "-m", "farm", "build", str(m), "--cluster",
                               "--json"], env=cluster.env(tmp_path / f"client-{m.stem}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in (a, b)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    compiled = sum(r["summary"]["compiled"] for r in reports)
    assert compiled == 10, [r["summary"] for r in reports]  # each kernel compiled once
    for r in reports:
        assert r["summary"]["failed"] == 0
        assert r["summary"]["loaded"] + r["summary"]["rekeyed"] + r["summary"]["compiled"] == 10


def test_version_skew_is_refused_and_nothing_is_stored(cluster: LocalCluster,
                                                       tmp_path: Path) -> None:
    client_code = _skew_module(tmp_path / "client-code", "client, edited")
    manifest = tmp_path / "skew.toml"
    manifest.write_text(write_manifest(tmp_path / "base.toml", salt=13, count=3).read_text()
                        + '\n[[kernels]]\nfamily = "skew_scale"\nparams = { factor = 3 }\n')
    env = cluster.env(tmp_path / "client", PYTHONPATH=str(client_code))
    proc = farm(env, "build", str(manifest), "--cluster", "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["summary"]["compiled"] == 3
    [failure] = report["failures"]
    assert failure["kind"] == "version-skew"
    assert "client build id" in failure["message"] and "worker build id" in failure["message"]
    store = minio_store(cluster)
    ns = namespace(report["fingerprint"])
    skew_id = failure["key"].split(".")[0]
    assert not [k for k in store.keys(ns) if k.id_hash == skew_id]


def test_unserved_fingerprint_fails_fast_and_falls_back_locally(cluster: LocalCluster,
                                                                tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", salt=14, count=2)
    start = time.monotonic()
    proc = farm(cluster.env(tmp_path / "c1"), "build", str(manifest), "--cluster",
                "--fingerprint", "pocl-nowhere-000000000000")
    assert proc.returncode != 0
    assert time.monotonic() - start < 15
    assert "no worker serves fingerprint pocl-nowhere-000000000000" in proc.stderr
    assert "Traceback" not in proc.stderr
    served = json.loads(farm(cluster.env(), "workers", "--json").stdout)
    assert next(iter(served)) in proc.stderr  # names the fingerprints that are served

    # An empty Redis database, numbered as every cluster's is (a fixed number was some
    # other module's cluster in some random orders): nobody serves the local device there.
    lonely = cluster.env(tmp_path / "c2")
    lonely["FARM_REDIS_URL"] = cluster.redis_url.rsplit("/", 1)[0] + f"/{next_redis_db()}"
    proc = farm(lonely, "build", str(manifest), "--cluster")
    assert proc.returncode != 0 and "no worker serves fingerprint" in proc.stderr
    proc = farm(lonely, "build", str(manifest), "--cluster", "--fallback-local", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["compiled"] == 2


def test_a_piped_cluster_build_and_farm_workers_read_at_80_columns(cluster: LocalCluster,
                                                                  tmp_path: Path) -> None:
    """What a person reads of the cluster: a build given a fingerprint prefix prints
    progress lines (count, rate, ETA, chunks in flight) although piped, and its summary
    fits 80 columns; `farm workers` shows the fingerprint whole and names the pool
    processes as the build's "work by worker process" does."""
    import re

    served = json.loads(farm(cluster.env(), "workers", "--json").stdout)
    fingerprint = next(iter(served))
    env = {**cluster.env(tmp_path / "client"), "COLUMNS": "80"}
    manifest = write_manifest(tmp_path / "m.toml", salt=39, count=6)
    proc = farm(env, "build", str(manifest), "--cluster", "--fingerprint", fingerprint[:9])
    assert proc.returncode == 0, proc.stderr
    # the count on its line; the last kernel and the chunks in flight on theirs (issue 32:
    # together they were wider than the terminal), no line over 80 columns
    assert re.search(r"^building: \d+/6 kernels \(\d+%\), [\d.]+/s, ETA \d+:\d\d, elapsed "
                     r"\d+:\d\d\n  last: Compiled reduce\(cols=390\d", proc.stderr, re.M), \
        proc.stderr
    assert all(len(line) <= 80 for line in proc.stderr.splitlines()), proc.stderr
    assert "…" not in proc.stdout
    assert all(len(line.rstrip()) <= 80 for line in proc.stdout.splitlines()), proc.stdout
    # the title, wrapped at a space where the fingerprint does not fit beside it (Debian's
    # PoCL names its CPU target: 58 characters), never through the fingerprint
    title = proc.stdout.splitlines()[:2]
    assert f"farm build salted-39 on {fingerprint}" in " ".join(" ".join(title).split())
    assert any(fingerprint in line for line in title), title
    build_names = set(re.findall(r"^(\S+:\d+)\s+\d+\s+\d+\s+[\d.]+ s$", proc.stdout, re.M))
    assert build_names, proc.stdout

    listed = farm(env, "workers")
    assert listed.returncode == 0, listed.stderr
    assert "…" not in listed.stdout
    assert all(len(line.rstrip()) <= 80 for line in listed.stdout.splitlines()), listed.stdout
    assert fingerprint in listed.stdout.splitlines()
    workers = json.loads(farm(env, "workers", "--json").stdout)[fingerprint]["workers"]
    pools = {f"{w['host']}:{pid}" for w in workers for pid in w["pool"]}
    assert len(pools) == 2 and build_names <= pools  # the same names in both
    for w in workers:
        assert re.search(rf"^{re.escape(w['host'])}:{w['pid']}\s+\S", listed.stdout, re.M)
        for pid in w["pool"]:
            assert f"{w['host']}:{pid}" in listed.stdout


def test_corrupted_artifact_in_minio_is_detected_recompiled_and_repaired(
        cluster: LocalCluster, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", salt=15, count=3)
    first = build_json(cluster.env(tmp_path / "c1"), str(manifest))
    assert first["summary"]["compiled"] == 3
    store = minio_store(cluster)
    ns = namespace(first["fingerprint"])
    victim = _keys(manifest)[1]
    good = store.get(ns, victim)
    assert good is not None
    from io import BytesIO

    from minio import Minio

    from farm.core.keys import artifact_object

    raw = Minio(cluster.minio_endpoint, access_key=cluster.minio_access_key,
                secret_key=cluster.minio_secret_key, secure=False)
    evil = b"\x00corrupted\x00" * 50
    raw.put_object(cluster.bucket, artifact_object(ns, victim), BytesIO(evil), len(evil))
    assert store.get(ns, victim) is None  # detected by its digest

    again = build_json(cluster.env(tmp_path / "c2"), str(manifest), "--verify")
    assert again["summary"]["compiled"] == 1, again["summary"]
    assert again["summary"]["loaded"] == 2
    repaired = store.get(ns, victim)
    assert repaired is not None and repaired.verify()


def test_worker_killed_mid_build_loses_nothing(redis_server: Any, minio_server: Any,
                                               tmp_path: Path) -> None:
    with local_cluster(tmp_path, redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       **{**LIMITS, "FARM_CHUNK_SIZE": "1", "FARM_DEAD_WORKER_GRACE": "3",
                          "FARM_HEARTBEAT_INTERVAL": "0.5"}) as c:
        victim = c.start_worker()
        c.start_worker()
        c.wait_ready()
        manifest = write_manifest(tmp_path / "m.toml", salt=16, count=12)
        client = subprocess.Popen(
            [sys.executable, "-m", "farm", "build", str(manifest), "--cluster", "--json"],
            env=c.env(tmp_path / "client"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        deadline = time.monotonic() + 120
        while "received" not in victim.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, "the victim never received a task"
            time.sleep(0.05)
        victim.kill_all()  # SIGKILL main process and pool: the whole worker dies
        out, err = client.communicate(timeout=300)
        assert client.returncode == 0, err
        report = json.loads(out)
        s = report["summary"]
        assert s["failed"] == 0, report["failures"]
        assert s["compiled"] + s["rekeyed"] + s["loaded"] == 12
        store = minio_store(c)
        ns = namespace(report["fingerprint"])
        stored = list(store.keys(ns))
        assert sorted(stored, key=str) == sorted(set(stored), key=str)  # exactly once each
        assert set(_keys(manifest)) <= set(stored)
        assert len(stored) == 12


def test_kernels_the_target_cannot_run_are_never_sent(cluster: LocalCluster,
                                                      tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text(write_manifest(tmp_path / "base.toml", salt=17, count=1).read_text()
                        + '\n[[kernels]]\nfamily = "matmul"\n'
                        'params = { m = 64, n = 64, k = 64, tile_m = 128, tile_n = 128 }\n')
    first = build_json(cluster.env(tmp_path / "c1"), str(manifest))
    assert first["summary"]["unsupported"] == 1 and first["summary"]["compiled"] == 1
    assert first["summary"]["tasks_sent"] == 1  # the runnable kernel only
    assert "16384" in first["unsupported"][0]["message"]
    second = build_json(cluster.env(tmp_path / "c2"), str(manifest))
    assert second["summary"]["tasks_sent"] == 0
    assert second["summary"]["loaded"] == 1 and second["summary"]["unsupported"] == 1
